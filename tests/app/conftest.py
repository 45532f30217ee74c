"""Real `kvgate serve` processes on free ports, serving the tiny model, and in-process servers.

`server` (one per session) is the anonymous, default-configured server; `tenant_server` (one per
session) runs from a TOML file with tenants, an admin key, a small queue and a small body limit.
Both share one `KVGATE_CACHE_DIR`, so the tiny model is built once.

`start_app` serves `app.main.create_app` over real HTTP from a thread of the test process, with
the engine on a thread too (no `kvgate serve`, no engine process): for tests of HTTP behaviour
that need no signals, crashes, replicas, CLI or engine-process boundary (docs/testing.md).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]
KVGATE = str(Path(sys.executable).with_name("kvgate"))
ADMIN_KEY = "admin-secret-for-tests"
TENANT_KEYS = {"acme": "sk-acme-1", "beta": "sk-beta-1", "gamma": "sk-gamma-1"}
TENANT_CONFIG = f"""
[model]
path = "tiny"
max_model_len = 1024

[server]
max_queue = 1
max_body_bytes = 65536
secret = "tests-only-server-secret-0123456789"

[engine]
max_num_seqs = 1

[cache]
block_size = 16

[cache.device]
num_blocks = 256

[cache.host]
capacity_mb = 64

[admin]
api_key = "{ADMIN_KEY}"

[[tenants]]
name = "acme"
api_keys = ["{TENANT_KEYS['acme']}", "sk-acme-2"]

[[tenants]]
name = "beta"
api_keys = ["{TENANT_KEYS['beta']}"]
share_group = "team"

[[tenants]]
name = "gamma"
api_keys = ["{TENANT_KEYS['gamma']}"]
share_group = "team"
quota = {{ device = 128 }}
"""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServerProcess:
    """One `kvgate serve` subprocess; its output goes to a log file shown on failure."""

    def __init__(self, args: list[str], log_path: Path, env: dict[str, str], new_session: bool = False) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._log = log_path.open("w")
        # new_session: the server leads a process group of its own, so a test can signal the group
        self.proc = subprocess.Popen([KVGATE, "serve", "--port", str(self.port), *args], cwd=ROOT, env=env,
                                     stdout=self._log, stderr=subprocess.STDOUT, start_new_session=new_session)

    def log(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text()

    def wait_until(self, path: str = "/ready", timeout_s: float = 180.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvgate serve exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.url + path, timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"kvgate serve was not ready after {timeout_s}s:\n{self.log()}")

    def stop(self, timeout_s: float = 30.0) -> int:
        """SIGTERM, then wait; returns the exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


@pytest.fixture(scope="session")
def kvgate_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """Environment for servers (and this process): a private `KVGATE_CACHE_DIR`, no config."""
    cache_dir = str(tmp_path_factory.mktemp("kvgate-cache"))
    saved = os.environ.get("KVGATE_CACHE_DIR")
    os.environ["KVGATE_CACHE_DIR"] = cache_dir
    env = {k: v for k, v in os.environ.items() if k not in ("KVGATE_CONFIG", "KVGATE_SECRET")}
    env["KVGATE_CACHE_DIR"] = cache_dir
    env.setdefault("OMP_NUM_THREADS", "1")
    yield env
    if saved is None:
        os.environ.pop("KVGATE_CACHE_DIR", None)
    else:
        os.environ["KVGATE_CACHE_DIR"] = saved


@pytest.fixture(scope="session")
def start_server(kvgate_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory):
    """Factory: start a `kvgate serve` with extra args (and optional config text), wait for /ready."""
    started: list[ServerProcess] = []

    def start(*args: str, config: str | None = None, wait: str | None = "/ready",
              new_session: bool = False) -> ServerProcess:
        folder = tmp_path_factory.mktemp("server")
        argv = list(args)
        if config is not None:
            (folder / "kvgate.toml").write_text(config)
            argv = ["--config", str(folder / "kvgate.toml"), *argv]
        if "--disk-cache" not in argv:  # a disk tier per server: no test sees another's blocks
            argv = [*argv, "--disk-cache", str(folder / "kv")]
        server = ServerProcess(argv, folder / "server.log", kvgate_env, new_session)
        started.append(server)
        if wait is not None:
            server.wait_until(wait)
        return server

    yield start
    for server in started:  # all at once: each drains and writes its cache to disk on SIGTERM
        if server.proc.poll() is None:
            server.proc.send_signal(signal.SIGTERM)
    for server in started:
        server.stop()


@pytest.fixture(scope="session")
def server(start_server) -> ServerProcess:
    """Anonymous server: `kvgate serve --model tiny`, default configuration."""
    return start_server("--model", "tiny")


@pytest.fixture(scope="session")
def tenant_server(start_server) -> ServerProcess:
    """Server from a TOML file: three tenants (two share a group), admin key, queue of 1."""
    return start_server(config=TENANT_CONFIG)


class AppServer:
    """`create_app` with a thread engine, served by uvicorn on a thread of this process.

    Takes the `kvgate serve` flags the tests use (--config, --model, --disk-cache,
    --remote-cache) and turns them into settings overrides as `kvgate serve` does; POST
    /admin/reload re-reads the same file. `url` and `stop()` as `ServerProcess`.
    """

    def __init__(self, argv: list[str]) -> None:
        import uvicorn

        from app.cli import build_parser
        from app.main import create_app
        from app.settings import load_settings
        from engine.async_engine import AsyncEngine

        args = build_parser().parse_args(["serve", *argv])
        overrides: dict[str, object] = {"model.path": args.model, "cache.host.capacity_mb": args.host_cache_mb}
        if args.disk_cache == "off":
            overrides["cache.disk.capacity_mb"] = 0
        elif args.disk_cache is not None:
            overrides["cache.disk.path"] = args.disk_cache
        if args.remote_cache is not None:
            overrides["cache.remote.url"] = "" if args.remote_cache == "off" else args.remote_cache
        settings = load_settings(args.config, overrides)
        engine = AsyncEngine.from_config(settings.engine_config(), process=False)
        self.app = create_app(settings, engine=engine, reload=lambda: load_settings(args.config, overrides))
        self._listener = socket.socket()
        self._listener.bind(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(self.app, log_config=None, access_log=False, lifespan="on")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._listener]},
                                        name="kvgate-test-app", daemon=True)
        self._thread.start()

    def wait_until(self, path: str = "/ready", timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self._thread.is_alive():
                raise RuntimeError(f"the in-process server stopped before {path} answered 200")
            try:
                if httpx.get(self.url + path, timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"the in-process server was not ready after {timeout_s}s")

    def stop(self, timeout_s: float = 60.0) -> None:
        """uvicorn's shutdown: the lifespan's end stops the engine."""
        self._server.should_exit = True
        self._thread.join(timeout_s)
        self._listener.close()
        assert not self._thread.is_alive(), "the in-process server did not stop"


@pytest.fixture(scope="module")
def start_app(kvgate_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory
              ) -> Iterator[Callable[..., AppServer]]:
    """Factory: an in-process server (flags and optional config text as `start_server`), ready.

    Module-scoped: every server it started is stopped when the module's tests are done."""
    started: list[AppServer] = []

    def start(*args: str, config: str | None = None) -> AppServer:
        folder = tmp_path_factory.mktemp("app")
        argv = list(args)
        if config is not None:
            (folder / "kvgate.toml").write_text(config)
            argv = ["--config", str(folder / "kvgate.toml"), *argv]
        if "--disk-cache" not in argv:  # a disk tier per server: no test sees another's blocks
            argv = [*argv, "--disk-cache", str(folder / "kv")]
        server = AppServer(argv)
        started.append(server)
        server.wait_until()
        return server

    yield start
    for server in started:
        server.stop()


@pytest.fixture()
def http(server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield client


def wait_for_idle(client: httpx.Client, headers: dict[str, str] | None = None, timeout_s: float = 10.0) -> dict:
    """Poll /admin/metrics until no KV block is in use; returns the last metrics."""
    deadline = time.monotonic() + timeout_s
    while True:
        metrics = client.get("/admin/metrics", headers=headers).json()
        if metrics["blocks_in_use"] == 0 and metrics["num_running"] == 0 and metrics["num_waiting"] == 0:
            return metrics
        if time.monotonic() > deadline:
            return metrics
        time.sleep(0.05)


def assert_error(response: httpx.Response, status: int, param: str | None = None,
                 code: str | None = None) -> dict:
    """The OpenAI error shape, exactly: {"error": {message, type, param, code}}."""
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    body = response.json()
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str) and error["type"]
    if param is not None:
        assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error
    return error
