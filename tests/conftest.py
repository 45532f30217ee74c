"""Shared fixtures: one tiny Llama built per test session, raw and loaded."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import settings

from engine.model import LoadedModel, load_model
from engine.tiny_model import build_tiny_model

# CI must be reproducible: property tests use a fixed example sequence there (and no example
# database); local runs keep exploring with fresh random examples.
settings.register_profile("ci", derandomize=True, database=None)
if os.environ.get("CI"):
    settings.load_profile("ci")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slow: takes more than a few seconds (still runs by default)")
    # Cost markers (docs/testing.md), one per test, set by pytest_collection_modifyitems below:
    # `pytest -m "unit or engine"` is the fast set.
    for name, meaning in COST_MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {meaning}")
    # Every engine of the run (servers with private cache folders included) loads the native CPU
    # kernels from one build, made here once instead of inside a server's start-up timeout.
    from engine import kernels

    os.environ.setdefault("KVGATE_KERNEL_DIR", str(kernels.build_dir().parent))
    kernels.load()


COST_MARKERS = {
    "unit": "no model and no other process: pure Python, fast",
    "engine": "loads the tiny model in this process (tests/engine, tiny_model_dir, tiny_loaded, start_app)",
    "server": "starts another process: `kvgate serve` (server, tenant_server, start_server), the kvgate CLI, "
              "a Python interpreter or a Redis cluster",
    "e2e": "whole deployments: tests/deploy, tests/loadtest, the dashboard in Chromium",
}
_E2E_PATHS = ("tests/deploy/", "tests/loadtest/", "tests/app/test_dashboard.py")
_SERVER_FIXTURES = {"start_server", "server", "tenant_server"}
_ENGINE_FIXTURES = {"tiny_model_dir", "tiny_loaded", "start_app"}


def _starts_a_process(functions: list) -> bool:
    """True when one of `functions`, or a helper of a `tests` module one of them calls, names
    `subprocess` (a nested function or lambda counts as part of its function)."""
    import types

    seen: set = set()
    stack = [f.__code__ for f in functions if hasattr(f, "__code__")]
    globals_of = {f.__code__: f.__globals__ for f in functions if hasattr(f, "__code__")}
    while stack:
        code = stack.pop()
        if code in seen:
            continue
        seen.add(code)
        if "subprocess" in code.co_names:
            return True
        scope = globals_of.get(code, {})
        for name in code.co_names:
            helper = scope.get(name)
            if isinstance(helper, types.FunctionType) and helper.__module__.startswith("tests."):
                globals_of.setdefault(helper.__code__, helper.__globals__)
                stack.append(helper.__code__)
        for const in code.co_consts:
            if isinstance(const, types.CodeType):
                globals_of.setdefault(const, scope)
                stack.append(const)
    return False


def _cost(item: pytest.Item, root: Path) -> str:
    try:
        path = Path(item.path).resolve().relative_to(root).as_posix()
    except ValueError:  # a test file outside the repository
        path = Path(item.path).as_posix()
    if path.startswith(_E2E_PATHS):
        return "e2e"
    fixtures = set(getattr(item, "fixturenames", ()))
    if fixtures & _SERVER_FIXTURES:
        return "server"
    # the test, and the fixtures of its own module, with the helpers they call
    functions = [getattr(item, "function", None)]
    defs = getattr(getattr(item, "_fixtureinfo", None), "name2fixturedefs", {})
    module = getattr(getattr(item, "module", None), "__name__", None)
    functions += [d[-1].func for d in defs.values() if d and getattr(d[-1].func, "__module__", None) == module]
    if _starts_a_process([f for f in functions if f is not None]):
        return "server"
    if path.startswith("tests/engine/") or fixtures & _ENGINE_FIXTURES:
        return "engine"
    return "unit"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Give every test one cost marker (docs/testing.md); a marker set in the test file wins."""
    root = Path(__file__).resolve().parents[1]
    for item in items:
        if not any(item.get_closest_marker(name) for name in COST_MARKERS):
            item.add_marker(_cost(item, root))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Folder of the deterministic tiny model (seed 0), built once per session."""
    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny", seed=0, size="tiny")


@pytest.fixture(scope="session")
def tiny_loaded(tiny_model_dir: Path) -> LoadedModel:
    """The tiny model loaded through `load_model` (float32, device auto)."""
    return load_model(str(tiny_model_dir))


class RedisServer:
    """A private `redis-server` on a free loopback port (never the machine's shared one)."""

    def __init__(self, folder: Path) -> None:
        import shutil
        import socket
        import subprocess

        binary = shutil.which("redis-server")
        if binary is None:
            pytest.fail("redis-server is not installed: `apt-get install redis-server` (.ci/run does this)")
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self._log = (folder / "redis.log").open("w")
        self.proc = subprocess.Popen(
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(folder), "--protected-mode", "yes"], stdout=self._log, stderr=subprocess.STDOUT)
        self.wait_ready()

    def client(self):
        import redis

        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=5)

    def wait_ready(self, timeout_s: float = 15.0) -> None:
        import time

        import redis

        deadline = time.monotonic() + timeout_s
        while True:
            try:
                with self.client() as client:
                    client.ping()
                return
            except redis.RedisError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise RuntimeError(f"redis-server on port {self.port} did not start") from None
                time.sleep(0.05)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except Exception:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory):
    """One private redis-server for the session; stopped at the end."""
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    yield server
    server.stop()


@pytest.fixture()
def redis_url(redis_server: RedisServer) -> str:
    """The private server's URL, emptied before the test (it is ours alone)."""
    with redis_server.client() as client:
        client.flushall()
    return redis_server.url
