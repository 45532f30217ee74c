"""A throw-away cluster for the multi-replica benchmarks (router_bench, pd_bench): a private
redis-server, `kvgate serve` replicas and a `kvgate route` in front of them, all child processes
in a temporary folder, every one stopped and the folder removed on exit (also on Ctrl-C, SIGTERM
or an error).

    Cluster (a context manager, one temporary folder)
      ├─ redis-server --port <free> --save '' --appendonly no      (never the shared 6379)
      ├─ kvgate serve --config <cfg> --port <free> --disk-cache <folder>/<name>-kv   × n
      └─ kvgate route --config <cfg> --replica ... --policy P --port <free>

Each child leads a process group of its own, so a replica's engine process goes with it, and
`kill` (SIGKILL to the group) is a replica's sudden death.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
ADMIN_KEY = "bench-cluster-admin-key"
SECRET = "bench-cluster-secret-0123456789abcdef"
TENANT_KEYS = {"tenant-a": "sk-bench-a", "tenant-b": "sk-bench-b", "tenant-c": "sk-bench-c"}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def config_text(model: str, redis_url: str, *, role: str = "both", device_blocks: int = 1024, host_mb: int = 1024,
                threads: int | None = 1, tenants: int = 2) -> str:
    """One replica's TOML: shared secret, tenants and Redis; KV events on free ports; ``role``."""
    threads_line = f"num_threads = {threads}\n" if threads else ""
    tenant_lines = "".join(f'[[tenants]]\nname = "{name}"\napi_keys = ["{key}"]\n\n'
                           for name, key in list(TENANT_KEYS.items())[:tenants])
    return f"""[model]
path = "{model}"

[server]
secret = "{SECRET}"
role = "{role}"

[engine]
{threads_line}
[cache.device]
num_blocks = {device_blocks}

[cache.host]
capacity_mb = {host_mb}

[cache.disk]
capacity_mb = 4096

[cache.remote]
url = "{redis_url}"
write = "through"

[events]
endpoint = "tcp://127.0.0.1:*"
replay_endpoint = "tcp://127.0.0.1:*"

[admin]
api_key = "{ADMIN_KEY}"

{tenant_lines}"""


def get_json(url: str, key: str = ADMIN_KEY, timeout_s: float = 10.0) -> dict[str, Any]:
    request = urllib.request.Request(url)
    request.add_header("Authorization", f"Bearer {key}")
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        return json.load(response)


@dataclass
class Child:
    """One process the cluster started (the leader of its own process group)."""

    name: str
    proc: subprocess.Popen
    log: Path
    url: str = ""

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


class Cluster:
    """Starts and stops the benchmark's processes; see the module docstring."""

    def __init__(self, label: str, say: Any, keep: Path | None = None) -> None:
        self.say = say
        self.work = keep if keep is not None else Path(tempfile.mkdtemp(prefix=f"kvgate-{label}-"))
        self.work.mkdir(parents=True, exist_ok=True)
        self.keep = keep is not None
        self.children: list[Child] = []
        self.redis_url = ""
        self.env = {k: v for k, v in os.environ.items() if k != "KVGATE_CONFIG"}
        self._old_term: Any = None

    # ---- lifetime -------------------------------------------------------------------------------
    def __enter__(self) -> Cluster:
        self._old_term = signal.signal(signal.SIGTERM, _raise_interrupt)
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
        signal.signal(signal.SIGTERM, self._old_term or signal.SIG_DFL)

    def close(self) -> None:
        """SIGTERM every group still running (all at once: replicas drain in parallel; Redis last,
        so that their last writes reach it), SIGKILL what is left after 20 s, remove the folder."""
        order = sorted(self.children, key=lambda c: c.name == "redis")
        for child in order:
            if child.name == "redis":
                _wait_all([c for c in order if c.name != "redis"], 20)
            _signal_group(child, signal.SIGTERM)
        deadline = time.monotonic() + 20
        for child in order:
            try:
                child.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            _signal_group(child, signal.SIGKILL)  # the group: an engine process outliving its server too
            try:
                child.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.say(f"{child.name} (pid {child.proc.pid}) did not exit")
        self.children.clear()
        if not self.keep:
            shutil.rmtree(self.work, ignore_errors=True)

    def spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> Child:
        log = self.work / f"{name}.log"
        with log.open("w") as out:
            proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, env=env or self.env,
                                    start_new_session=True)
        child = Child(name, proc, log)
        self.children.append(child)
        return child

    def kill(self, child: Child) -> None:
        """SIGKILL a child's whole process group: a sudden death, nothing drained."""
        _signal_group(child, signal.SIGKILL)
        child.proc.wait(10)

    # ---- the pieces -----------------------------------------------------------------------------
    def start_redis(self) -> str:
        if shutil.which("redis-server") is None:
            raise SystemExit("redis-server is needed (apt-get install redis-server)")
        port = free_port()
        self.spawn("redis", ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--dir", str(self.work)])
        deadline = time.monotonic() + 10
        while True:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1) as sock:
                    sock.sendall(b"PING\r\n")
                    if sock.recv(16).startswith(b"+PONG"):
                        break
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError("the private redis-server did not start") from None
                time.sleep(0.05)
        self.redis_url = f"redis://127.0.0.1:{port}/0"
        self.say(f"private redis-server on port {port}")
        return self.redis_url

    def start_replica(self, name: str, config: Path) -> Child:
        port = free_port()
        kvgate = str(Path(sys.executable).parent / "kvgate")
        child = self.spawn(name, [kvgate, "serve", "--config", str(config), "--port", str(port),
                                  "--disk-cache", str(self.work / f"{name}-kv"), "--log-level", "warning"])
        child.url = f"http://127.0.0.1:{port}"
        return child

    def start_router(self, config: Path, replicas: list[Child], policy: str = "prefix") -> Child:
        port = free_port()
        kvgate = str(Path(sys.executable).parent / "kvgate")
        argv = [kvgate, "route", "--config", str(config), "--port", str(port), "--policy", policy,
                "--log-level", "warning"]
        for replica in replicas:
            argv += ["--replica", replica.url]
        child = self.spawn(f"router-{policy}", argv)
        child.url = f"http://127.0.0.1:{port}"
        return child

    def wait_ready(self, children: list[Child], timeout_s: float = 900.0, replicas: int = 0) -> None:
        """Until every child answers /ready (a router: with ``replicas`` replicas in rotation)."""
        start = time.monotonic()
        waiting = list(children)
        next_note = 30.0
        while waiting:
            for child in list(waiting):
                if not child.alive():
                    raise RuntimeError(f"{child.name} exited with {child.proc.returncode} before it was ready:\n"
                                       f"{child.log_tail()}")
                try:
                    with urllib.request.urlopen(child.url + "/ready", timeout=2) as response:
                        body = json.load(response)
                    if body.get("replicas_ready", replicas) >= replicas:
                        waiting.remove(child)
                except (OSError, ValueError):
                    pass
            elapsed = time.monotonic() - start
            if elapsed > timeout_s:
                raise RuntimeError(f"not ready after {timeout_s:.0f} s: {', '.join(c.name for c in waiting)}")
            if waiting and elapsed > next_note:
                self.say(f"still waiting for {', '.join(c.name for c in waiting)} ({elapsed:.0f} s)")
                next_note += 30
            time.sleep(0.3)


def _wait_all(children: list[Child], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    for child in children:
        try:
            child.proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass


def _signal_group(child: Child, sig: signal.Signals) -> None:
    try:
        os.killpg(child.proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def metrics(child: Child) -> dict[str, Any]:
    """A replica's /admin/metrics."""
    return get_json(child.url + "/admin/metrics")


def delta(after: dict[str, Any], before: dict[str, Any], *path: str) -> float:
    """``after[path] - before[path]`` of two /admin/metrics snapshots (0 where a counter is absent)."""
    def get(data: Any) -> float:
        for key in path:
            data = data.get(key) if isinstance(data, dict) else None
        return float(data) if isinstance(data, (int, float)) else 0.0

    return get(after) - get(before)


def router_state(router: Child) -> dict[str, Any]:
    """The router's /admin/router (replicas, decisions, index sizes)."""
    return get_json(router.url + "/admin/router")


def complete(url: str, key: str, body: dict[str, Any], timeout_s: float = 120.0) -> dict[str, Any]:
    """POST a non-streamed completion (a warm-up, a probe) for the served model; the JSON answer."""
    if "model" not in body:
        body = {**body, "model": get_json(url + "/v1/models", key)["data"][0]["id"]}
    request = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode())
    request.add_header("Content-Type", "application/json")
    request.add_header("Authorization", f"Bearer {key}")
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        return json.load(response)


def machine() -> dict[str, Any]:
    """The facts a figure needs beside it: CPU, cores, load at start, when."""
    cpu = ""
    try:
        cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                    if line.startswith("model name")), "")
    except OSError:
        pass
    return {"cpu_model": cpu, "cpu_count": os.cpu_count(), "load_1min": round(os.getloadavg()[0], 2),
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "python": sys.version.split()[0]}
