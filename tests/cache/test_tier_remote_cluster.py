"""RemoteTier against a real 3-node Redis Cluster started by the test (cluster = true); a dead node
turns its slots into misses while the other nodes keep serving."""

from __future__ import annotations

import asyncio
import random
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest

from cache.tiers.codec import BlockFormat
from cache.tiers.remote import RemoteTier

MAC_KEY = bytes(range(100, 132))  # the store key every replica of a test deployment shares

FMT = BlockFormat(bytes(range(32)), "float32", (2, 4))
PAYLOAD = bytes(range(32))


def _bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _free_port(rng: random.Random) -> int:
    """A free port whose cluster bus port (port + 10000) is free and valid too."""
    while True:
        port = rng.randrange(20000, 45000)
        if _bindable(port) and _bindable(port + 10000):
            return port


@pytest.fixture()
def cluster(tmp_path: Path):
    binary, cli = shutil.which("redis-server"), shutil.which("redis-cli")
    if binary is None or cli is None:
        pytest.fail("redis-server / redis-cli are not installed: `apt-get install redis-server`")
    ports: list[int] = []
    procs = []
    rng = random.Random()
    try:
        for i in range(3):
            port = _free_port(rng)
            while port in ports:
                port = _free_port(rng)
            folder = tmp_path / f"node{i}"
            folder.mkdir()
            procs.append(subprocess.Popen(
                [binary, "--port", str(port), "--bind", "127.0.0.1", "--cluster-enabled", "yes",
                 "--cluster-config-file", str(folder / "nodes.conf"), "--save", "", "--appendonly", "no",
                 "--dir", str(folder)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            ports.append(port)
        for port in ports:
            for _ in range(100):
                if subprocess.run([cli, "-p", str(port), "ping"], capture_output=True).stdout.strip() == b"PONG":
                    break
                time.sleep(0.05)
        created = subprocess.run([cli, "--cluster", "create", *[f"127.0.0.1:{p}" for p in ports],
                                  "--cluster-replicas", "0", "--cluster-yes"], capture_output=True, timeout=60)
        assert created.returncode == 0, created.stdout.decode() + created.stderr.decode()
        for _ in range(200):
            info = subprocess.run([cli, "-p", str(ports[0]), "cluster", "info"], capture_output=True).stdout
            if b"cluster_state:ok" in info:
                break
            time.sleep(0.05)
        yield ports, procs
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def test_cluster_round_trip_and_a_dead_node(cluster) -> None:
    ports, procs = cluster
    keys = [i.to_bytes(32, "big") for i in range(24)]  # spread over all three nodes' slots

    async def main() -> None:
        tier = RemoteTier(f"redis://127.0.0.1:{ports[0]}/0", FMT, cluster=True, timeout_s=1.0,
                          failures_to_open=100, mac_key=MAC_KEY)
        try:
            assert await tier.put([(k, PAYLOAD) for k in keys]) == len(keys)
            assert await tier.exists(keys) == [True] * len(keys)
            assert await tier.get(keys) == [PAYLOAD] * len(keys)
            dests = [bytearray(len(PAYLOAD)) for _ in keys]  # redis-py's replies, copied into them
            got = await tier.get(keys, [memoryview(d) for d in dests])
            assert all(g is not None and g.obj is d for g, d in zip(got, dests, strict=True))
            assert dests == [bytearray(PAYLOAD)] * len(keys)
            procs[2].kill()
            procs[2].wait()
            got = await tier.get(keys)  # the batch fails as a whole: misses, no exception, bounded time
            assert all(g in (None, PAYLOAD) for g in got)
            assert tier.stats.errors >= 1 or got.count(PAYLOAD) < len(keys)
        finally:
            await tier.close()

    asyncio.run(main())
