"""The shared store trusts only its own deployment, seen from outside: servers that share the
server secret share blocks through Redis (the one that attaches the remote tier over HTTP too,
the engine adding the key); a server with another secret shares nothing; a record sealed with
another secret's key, or with a flipped payload bit, is never loaded — the request recomputes,
the greedy text equals the cold run's, `unauthentic` counts it — and the key is never shown."""

from __future__ import annotations

import logging
import random
import time
from typing import Any

import httpx
import pytest

from cache.tiers.codec import HEADER_SIZE
from cache.tiers.store_mac import SEAL_SIZE, StoreMac
from tenants.registry import store_mac_key

SECRET = "store-mac-tests-secret-one-0123"
OTHER_SECRET = "store-mac-tests-secret-two-4567"
CONFIG = """
[model]
path = "tiny"

[server]
secret = "{secret}"

[cache]
block_size = 16
"""
BLOCKS = 18  # full blocks of a 290-token prompt; with the 8 tokens generated, still 18


def _ids(seed: int, n: int = 290) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 1000) for _ in range(n)]


def _complete(url: str, ids: list[int]) -> tuple[str, int]:
    body = {"model": "tiny", "prompt": ids, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    response = httpx.post(url + "/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    data = response.json()
    return data["choices"][0]["text"], data["usage"]["prompt_tokens_details"]["cached_tokens"]


def _remote(url: str) -> dict[str, Any]:
    tiers = httpx.get(url + "/admin/metrics", timeout=30).json()["tiers"]
    return {**tiers["remote"], "pending_writes": tiers["chain"]["pending_writes"]}


def _written(url: str, client: Any, puts: int) -> set[str]:
    """Block keys in Redis once the server's write-through has sent ``puts`` blocks in all."""
    for _ in range(200):
        remote = _remote(url)
        if remote["puts"] >= puts and remote["pending_writes"] == 0:
            break
        time.sleep(0.05)
    return {k.decode() for k in client.keys("kvgate:*") if b":owner:" not in k}


def _name_parts(name: str) -> tuple[bytes, bytes]:
    """(model fingerprint, block hash) of a key ``kvgate:<fingerprint hex>:<hash hex>``."""
    _, fingerprint, block_hash = name.split(":")
    return bytes.fromhex(fingerprint), bytes.fromhex(block_hash)


def test_one_secret_one_store(start_app, redis_url: str, redis_server: Any, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    one = start_app("--disk-cache", "off", "--remote-cache", redis_url, config=CONFIG.format(secret=SECRET))
    shared, forged, flipped = _ids(11), _ids(12), _ids(13)
    cold: dict[int, str] = {}
    keys: dict[int, set[str]] = {}
    with redis_server.client() as client:
        before: set[str] = set()
        for n, prompt in enumerate((shared, forged, flipped), start=1):
            cold[n], cached = _complete(one.url, prompt)
            assert cached == 0
            now = _written(one.url, client, n * BLOCKS)
            keys[n], before = now - before, now
            assert len(keys[n]) == BLOCKS

    # a replica with the same secret, its remote tier attached over HTTP: the engine adds the key,
    # a request may not bring one
    two = start_app("--disk-cache", "off", "--remote-cache", "off", config=CONFIG.format(secret=SECRET))
    key = store_mac_key(SECRET.encode())
    refused = httpx.post(two.url + "/admin/tiers", json={"action": "attach", "tier": "remote", "url": redis_url,
                                                         "mac_key": key.hex()}, timeout=30)
    assert refused.status_code == 400 and "mac_key" in refused.text and key.hex() not in refused.text
    attached = httpx.post(two.url + "/admin/tiers", json={"action": "attach", "tier": "remote", "url": redis_url},
                          timeout=30)
    assert attached.status_code == 200, attached.text
    text, cached = _complete(two.url, shared)
    assert (text, cached) == (cold[1], 16 * BLOCKS)
    remote = _remote(two.url)
    assert remote["hits"] >= BLOCKS and remote["unauthentic"] == 0 and remote["mac"] == "poly1305"

    # the same blocks sealed with another secret's key, under the very names two looks up
    other_mac_key = store_mac_key(OTHER_SECRET.encode())
    with redis_server.client() as client:
        planted: dict[str, bytes] = {}
        for name in keys[2]:
            fingerprint, block_hash = _name_parts(name)
            record = client.get(name)[SEAL_SIZE:]
            planted[name] = StoreMac(other_mac_key, fingerprint).seal(block_hash, record) + record
        for n, name in enumerate(sorted(keys[3])):  # one flipped payload bit per record, at various places
            value = bytearray(client.get(name))
            value[SEAL_SIZE + HEADER_SIZE + (n * 40_009) % (len(value) - SEAL_SIZE - HEADER_SIZE)] ^= 0x04
            planted[name] = bytes(value)
        for name, value in planted.items():
            client.set(name, value)
    for n, prompt, unauthentic in ((2, forged, BLOCKS), (3, flipped, 2 * BLOCKS)):
        text, cached = _complete(two.url, prompt)
        assert (text, cached) == (cold[n], 0)  # recomputed: the same greedy text
        remote = _remote(two.url)
        assert remote["unauthentic"] == unauthentic and remote["hits"] == BLOCKS and remote["corrupt"] == 0
    assert sum("failed authentication" in r.getMessage() for r in caplog.records) >= 2
    with redis_server.client() as client:
        for name, value in planted.items():  # deleted (two's recomputed blocks may stand there again)
            now = client.get(name)
            assert now != value
            if now is not None:
                fingerprint, block_hash = _name_parts(name)
                StoreMac(key, fingerprint).open(block_hash, now)

    # a server with another secret: other salts, other keys; it shares nothing, loads nothing
    three = start_app("--disk-cache", "off", "--remote-cache", redis_url, config=CONFIG.format(secret=OTHER_SECRET))
    text, cached = _complete(three.url, shared)
    assert (text, cached) == (cold[1], 0)
    remote = _remote(three.url)
    assert remote["hits"] == 0 and remote["unauthentic"] == 0 and remote["corrupt"] == 0

    # the key is never shown: not in metrics, tiers, Prometheus, logs
    prometheus = httpx.get(two.url + "/metrics", timeout=30).text
    assert f'kvgate_tier_unauthentic_blocks_total{{tier="remote"}} {2 * BLOCKS}.0' in prometheus
    shown = [prometheus, caplog.text] + [httpx.get(s.url + path, timeout=30).text
                                         for s in (one, two, three) for path in ("/admin/metrics", "/admin/tiers")]
    for secret_key in (key, other_mac_key):
        assert not any(secret_key.hex() in text or str(secret_key)[2:-1] in text for text in shown)
