"""Replicas behave as one cache: two `kvgate serve` processes (tiny model, a disk folder each) on
one private Redis, and on a local 3-node Redis Cluster started by `loadtest/redis_cluster.sh`.

A prefix computed on replica A is a hit on replica B (`cached_tokens` and `/admin/metrics`); with
one cluster node killed, both replicas still answer every request with the same greedy text,
recomputing what they cannot load, and count the failures. Both run from the compose config
(`loadtest/compose/kvgate.toml`, its Redis URL pointed at the test's own), so its two tenants and
keys are what the replicas serve. Every fixture stops what it started and removes its folders
(Redis is set up before the replicas, so they stop first; the cluster goes with
`redis_cluster.sh clean`, which must leave no node running and no folder).
"""

from __future__ import annotations

import os
import random
import re
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from app.settings import load_settings
from tests.app.conftest import ROOT, ServerProcess
from tests.conftest import RedisServer

pytestmark = pytest.mark.slow

COMPOSE_CONFIG = ROOT / "loadtest" / "compose" / "kvgate.toml"
CLUSTER_SCRIPT = ROOT / "loadtest" / "redis_cluster.sh"
SECRET = "replica-tests-shared-secret-0123456789"  # one secret: the replicas' namespaces agree
CONFIG = load_settings(COMPOSE_CONFIG, env={"KVGATE_SECRET": SECRET})
ADMIN = {"Authorization": f"Bearer {CONFIG.admin.api_key}"}
KEYS = {tenant.name: tenant.api_keys[0] for tenant in CONFIG.tenants}
BLOCK = CONFIG.cache.block_size


def replica_config(url: str, cluster: bool = False) -> str:
    """The compose config with its Redis URL replaced (and `cluster = true` for a cluster); its KV
    event sockets on free ports, as two replicas on one machine need (in compose each has its own
    network namespace)."""
    text, count = re.subn(r'(?m)^url = "redis://[^"]*"', f'url = "{url}"', COMPOSE_CONFIG.read_text())
    assert count == 1, "loadtest/compose/kvgate.toml should have exactly one [cache.remote] url"
    text, count = re.subn(r'(?m)^(endpoint|replay_endpoint) = "tcp://\*:\d+"', r'\1 = "tcp://127.0.0.1:*"', text)
    assert count == 2, "loadtest/compose/kvgate.toml should publish KV events (endpoint, replay_endpoint)"
    if cluster:
        text = text.replace("[cache.remote]\n", "[cache.remote]\ncluster = true\n", 1)
    return text


def _ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 1000) for _ in range(n)]


def complete(server: ServerProcess, ids: list[int], tenant: str = "acme") -> tuple[str, int]:
    """One greedy completion; returns its text and `cached_tokens`."""
    body = {"model": "tiny", "prompt": ids, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    response = httpx.post(server.url + "/v1/completions", json=body, timeout=60,
                          headers={"Authorization": f"Bearer {KEYS[tenant]}"})
    assert response.status_code == 200, response.text
    data = response.json()
    return data["choices"][0]["text"], data["usage"]["prompt_tokens_details"]["cached_tokens"]


def tiers(server: ServerProcess) -> dict:
    response = httpx.get(server.url + "/admin/metrics", headers=ADMIN, timeout=30)
    assert response.status_code == 200, response.text
    return response.json()["tiers"]


def wait_written(server: ServerProcess, puts: int, timeout_s: float = 15.0) -> dict:
    """Write-through is asynchronous: wait until `puts` blocks went out and none is pending."""
    deadline = time.monotonic() + timeout_s
    while True:
        current = tiers(server)
        if current["remote"]["puts"] >= puts and current["chain"]["pending_writes"] == 0:
            return current
        assert time.monotonic() < deadline, f"blocks not written to the remote tier: {current['remote']}"
        time.sleep(0.05)


def _bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _listening(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def cluster_ports(rng: random.Random) -> list[int]:
    """Three free ports whose cluster bus ports (port + 10000) are free too."""
    ports: list[int] = []
    while len(ports) < 3:
        port = rng.randrange(20000, 45000)
        if port not in ports and _bindable(port) and _bindable(port + 10000):
            ports.append(port)
    return ports


@pytest.fixture(scope="module")
def replica_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """Environment of the replicas: one `KVGATE_CACHE_DIR` (the tiny model is built once), one
    secret, no config from the caller."""
    cache_dir = tmp_path_factory.mktemp("replica-cache")
    env = {k: v for k, v in os.environ.items() if k not in ("KVGATE_CONFIG", "KVGATE_SECRET")}
    env.update(KVGATE_CACHE_DIR=str(cache_dir), KVGATE_SECRET=SECRET, OMP_NUM_THREADS="1")
    try:
        yield env
    finally:
        shutil.rmtree(cache_dir, ignore_errors=True)


@pytest.fixture()
def start_replicas(replica_env: dict[str, str], tmp_path: Path) -> Iterator[Callable[..., list[ServerProcess]]]:
    """Factory: start N replicas of one config, each with its own disk folder; wait for /ready."""
    started: list[ServerProcess] = []

    def start(config: str, count: int = 2) -> list[ServerProcess]:
        servers = []
        for _ in range(count):
            folder = tmp_path / f"replica-{len(started)}"
            folder.mkdir()
            (folder / "kvgate.toml").write_text(config)
            args = ["--config", str(folder / "kvgate.toml"), "--model", "tiny", "--disk-cache", str(folder / "kv")]
            server = ServerProcess(args, folder / "server.log", replica_env)
            started.append(server)
            servers.append(server)
        for server in servers:
            server.wait_until("/ready")
        return servers

    try:
        yield start
    finally:
        for server in started:  # SIGTERM to all first: the replicas drain side by side
            if server.proc.poll() is None:
                server.proc.send_signal(signal.SIGTERM)
        for server in started:
            try:
                server.proc.wait(30)
            except subprocess.TimeoutExpired:
                pass
            server.stop()  # closes the log; kills one that did not exit in time
        for server in started:
            shutil.rmtree(server.log_path.parent, ignore_errors=True)


@pytest.fixture()
def redis_single(tmp_path: Path) -> Iterator[RedisServer]:
    """A private redis-server for this test alone."""
    folder = tmp_path / "redis"
    folder.mkdir()
    server = RedisServer(folder)
    try:
        yield server
    finally:
        server.stop()
        shutil.rmtree(folder, ignore_errors=True)


class Cluster:
    """The 3-node cluster of `loadtest/redis_cluster.sh` in `folder`."""

    def __init__(self, folder: Path, ports: list[int]) -> None:
        self.folder = folder
        self.ports = ports
        self.url = f"redis://127.0.0.1:{ports[0]}"

    def script(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["bash", str(CLUSTER_SCRIPT), *args], capture_output=True, text=True, timeout=90)

    def kill(self, port: int) -> None:
        """SIGKILL one node's redis-server, and wait until it is gone."""
        pid = int((self.folder / f"node-{port}" / "redis.pid").read_text())
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while _alive(pid):
            assert time.monotonic() < deadline, f"redis-server {pid} did not die"
            time.sleep(0.05)


def _alive(pid: int) -> bool:
    try:
        return not Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    except FileNotFoundError:
        return False


@pytest.fixture()
def redis_cluster(tmp_path: Path) -> Iterator[Cluster]:
    """A local 3-node Redis Cluster started (and stopped, and removed) with the repository's script."""
    if shutil.which("redis-server") is None or shutil.which("redis-cli") is None:
        pytest.fail("redis-server / redis-cli are not installed: `apt-get install redis-server`")
    cluster = Cluster(tmp_path / "cluster", cluster_ports(random.Random()))
    try:
        started = cluster.script("start", str(cluster.folder), *map(str, cluster.ports))
        assert started.returncode == 0, started.stdout + started.stderr
        assert f'url = "{cluster.url}"' in started.stdout
        yield cluster
    finally:
        cleaned = cluster.script("clean", str(cluster.folder))
        leftover = cluster.folder.exists()
        shutil.rmtree(cluster.folder, ignore_errors=True)
        assert cleaned.returncode == 0, cleaned.stdout + cleaned.stderr
        assert not leftover, "redis_cluster.sh clean leaves nothing behind"
        assert not any(_listening(port) for port in cluster.ports), "a node is still running"


def test_two_replicas_on_one_redis_share_a_prefix(redis_single, start_replicas) -> None:
    a, b = start_replicas(replica_config(redis_single.url))
    prompt = _ids(21, 300)  # 18 full blocks of 16
    cold, cached = complete(a, prompt)
    assert cached == 0
    wait_written(a, puts=18)
    warm, cached = complete(b, prompt)  # B's first request for it
    assert warm == cold
    assert cached == 18 * BLOCK
    remote = tiers(b)["remote"]
    assert remote["hits"] >= 18 and remote["breaker"] == "closed" and remote["errors"] == 0
    # another tenant on B: its own namespace, so A's blocks are no hit for it on any replica
    other, cached = complete(b, prompt, tenant="globex")
    assert cached == 0 and other == cold


def test_two_replicas_on_a_redis_cluster_share_a_prefix_and_survive_a_dead_node(
        redis_cluster: Cluster, start_replicas) -> None:
    a, b = start_replicas(replica_config(redis_cluster.url, cluster=True))
    shared, only_a, fresh = _ids(31, 300), _ids(32, 300), _ids(33, 200)
    texts = {}
    for name, prompt in (("shared", shared), ("only_a", only_a)):
        texts[name], cached = complete(a, prompt)
        assert cached == 0
    wait_written(a, puts=36)
    warm, cached = complete(b, shared)
    assert warm == texts["shared"] and cached == 18 * BLOCK
    remote = tiers(b)["remote"]
    assert remote["hits"] >= 18 and remote["breaker"] == "closed" and remote["errors"] == 0

    redis_cluster.kill(redis_cluster.ports[2])  # not the node the URL names: the others still answer
    started = time.monotonic()
    text, _ = complete(b, only_a)  # in the cluster, but its batch touches the dead node: recomputed
    assert text == texts["only_a"]
    fresh_a, _ = complete(a, fresh)
    fresh_b, _ = complete(b, fresh)
    assert fresh_a == fresh_b
    for server in (a, b):
        assert complete(server, shared)[0] == texts["shared"]  # device hits, as before
    assert time.monotonic() - started < 60
    for server in (a, b):
        remote = tiers(server)["remote"]
        assert remote["errors"] >= 1, remote
