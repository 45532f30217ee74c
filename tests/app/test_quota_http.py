"""Tenant block quotas from the config reach every tier of a running server: the noisy tenant's
unique prompts stay within its device and host quotas, the quiet tenant's hot prefix stays a hit,
and `/admin/metrics` shows each tier's holdings and limits."""

from __future__ import annotations

import random

import httpx

ADMIN = {"Authorization": "Bearer admin-key-quota"}
QUIET = {"Authorization": "Bearer sk-quiet"}
NOISY = {"Authorization": "Bearer sk-noisy"}
CONFIG = """
[model]
path = "tiny"

[cache]
block_size = 16

[cache.device]
num_blocks = 48

[cache.host]
capacity_mb = 1

[admin]
api_key = "admin-key-quota"

[[tenants]]
name = "quiet"
api_keys = ["sk-quiet"]

[[tenants]]
name = "noisy"
api_keys = ["sk-noisy"]
quota = { device = 8, host = 16, disk = 32 }
"""


def ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 1000) for _ in range(n)]


def complete(client: httpx.Client, headers: dict, prompt: list[int]) -> int:
    response = client.post("/v1/completions", headers=headers,
                           json={"model": "tiny", "prompt": prompt, "max_tokens": 1})
    assert response.status_code == 200, response.text
    return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_quotas_hold_over_http(start_app) -> None:
    server = start_app("--disk-cache", "off", config=CONFIG)
    try:
        with httpx.Client(base_url=server.url, timeout=60) as client:
            hot = ids(1, 160)
            complete(client, QUIET, hot + ids(2, 3))
            hits = []
            for i in range(3):
                for j in range(5):  # 200 unique blocks per round: more than device + host hold
                    complete(client, NOISY, ids(100 + 10 * i + j, 640))
                hits.append(complete(client, QUIET, hot + ids(200 + i, 3)))
            assert hits == [160, 160, 160]
            metrics = client.get("/admin/metrics", headers=ADMIN).json()
            device = metrics["prefix_cache"]["quota"]
            host = metrics["tiers"]["host"]["quota"]
            assert device["limits"] == {"noisy": 8} and device["owners"]["noisy"] <= 8
            assert host["limits"] == {"noisy": 16} and host["owners"]["noisy"] <= 16
            assert device["owners"]["quiet"] >= 10
    finally:
        server.stop()
