"""`/admin/metrics` and `/metrics` after a scripted workload whose reuse is known: the per-tier
hits, the prefix-cache counters and the seven gap metrics say what the workload must produce,
and the Prometheus text parses with prometheus_client's own parser."""

from __future__ import annotations

import random

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.app.conftest import ADMIN_KEY, TENANT_KEYS

PROMPT_BLOCKS = 31  # a 500-token prompt in 16-token blocks


def _config(redis_url: str) -> str:
    return f"""
[model]
path = "tiny"

[cache]
block_size = 16

[cache.device]
num_blocks = 48

[cache.host]
capacity_mb = 8

[cache.remote]
url = "{redis_url}"
"""


def _ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 1000) for _ in range(n)]


def _complete(client: httpx.Client, ids: list[int], max_tokens: int = 4, headers: dict | None = None) -> int:
    body = {"model": "tiny", "prompt": ids, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    response = client.post("/v1/completions", json=body, headers=headers)
    assert response.status_code == 200, response.text
    return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def _families(text: str) -> dict:
    return {f.name: f for f in text_string_to_metric_families(text)}


def _value(families: dict, metric: str, **labels: str) -> float:
    """The value of one sample (a counter's `_total` may be left off)."""
    for family in families.values():
        for sample in family.samples:
            if sample.name in (metric, metric + "_total") and all(
                    sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    raise AssertionError(f"no sample {metric}{labels}")


def test_metrics_follow_a_known_workload_in_json_and_prometheus(start_app, redis_url: str) -> None:
    server = start_app(config=_config(redis_url))
    with httpx.Client(base_url=server.url, timeout=60) as client:
        prompt = _ids(1, 500)
        assert _complete(client, prompt) == 0
        for seed in (2, 3):  # two other long prompts take the whole device pool
            _complete(client, _ids(seed, 600), max_tokens=1)
        assert _complete(client, prompt) == PROMPT_BLOCKS * 16  # from host
        assert _complete(client, prompt) == PROMPT_BLOCKS * 16  # now from the device
        requests = 5

        stats = client.get("/admin/metrics").json()
        text = client.get("/metrics")
    assert text.status_code == 200 and text.headers["content-type"].startswith("text/plain")
    families = _families(text.text)

    # per tier and prefix cache: what the workload must produce, the same in both formats
    host = stats["tiers"]["host"]
    assert host["hits"] == PROMPT_BLOCKS
    assert _value(families, "kvgate_tier_hits", tier="host") == PROMPT_BLOCKS
    assert _value(families, "kvgate_tier_puts", tier="remote") == stats["tiers"]["remote"]["puts"] > 0
    pc = stats["prefix_cache"]
    assert pc["hit_tokens"] == 2 * PROMPT_BLOCKS * 16
    assert _value(families, "kvgate_prefix_cache_hits") == pc["hit_tokens"]
    assert _value(families, "kvgate_prefix_cache_queries") == pc["query_tokens"] == 3 * 500 + 2 * 600
    assert _value(families, "kvgate_cached_tokens") == stats["requests"]["cached_tokens_total"] == 2 * 496
    assert _value(families, "kvgate_chain_promotions") == stats["tiers"]["chain"]["promotions"] >= PROMPT_BLOCKS
    assert _value(families, "kvgate_archetype_info", name=stats["archetype"]["name"]) == 1
    assert stats["archetype"]["name"] == "Hybrid-Tier"

    # request latencies, both sides of the engine
    assert stats["requests"]["ttft_s"]["count"] == requests
    assert _value(families, "kvgate_request_ttft_seconds_count") == requests
    assert _value(families, "kvgate_engine_ttft_seconds_count") == requests
    assert stats["timing"]["tier_load_s"]["count"] == 1  # the one request served from host

    # the seven gaps, each present and non-trivial
    gaps = stats["gaps"]
    assert set(gaps) == {"remote_access", "metadata", "completion_overhead", "block_life", "prefetch_slack",
                         "ttft_attribution", "traces"}
    assert gaps["remote_access"]["blocks"]["put"] >= PROMPT_BLOCKS and gaps["remote_access"]["read_share"] == 0.0
    assert gaps["metadata"]["per_request_s"]["count"] == requests and gaps["metadata"]["bytes_ratio"] > 0
    assert gaps["completion_overhead"]["remote_put"]["ops"] >= 1
    assert gaps["block_life"]["host"]["reuse_distance"]["count"] == PROMPT_BLOCKS
    assert gaps["block_life"]["device"]["reuse_distance"]["count"] >= PROMPT_BLOCKS
    assert gaps["prefetch_slack"]["loads"] == 1 and gaps["prefetch_slack"]["slack_s"]["count"] == requests
    att = gaps["ttft_attribution"]
    assert att["samples"] == requests and abs(sum(att["shares"].values()) - 1) < 1e-9
    assert gaps["traces"]["recorded"] >= requests
    for name in ("kvgate_remote_batch_blocks", "kvgate_metadata_seconds", "kvgate_tier_op_issue_to_done_seconds",
                 "kvgate_block_reuse_distance", "kvgate_prefetch_slack_seconds",
                 "kvgate_ttft_p99_attribution_seconds", "kvgate_trace_records"):
        assert families[name].samples, name

    # every histogram is well formed: cumulative buckets ending at +Inf == _count
    for family in families.values():
        if family.type != "histogram":
            continue
        series: dict[tuple, list] = {}
        for sample in family.samples:
            key = tuple(sorted((k, v) for k, v in sample.labels.items() if k != "le"))
            series.setdefault(key, []).append(sample)
        for samples in series.values():
            buckets = [s.value for s in samples if s.name.endswith("_bucket")]
            count = next(s.value for s in samples if s.name.endswith("_count"))
            assert buckets == sorted(buckets) and buckets[-1] == count, family.name


def test_metrics_need_the_admin_key_and_count_tenants_apart(tenant_server) -> None:
    with httpx.Client(base_url=tenant_server.url, timeout=60) as client:
        assert client.get("/metrics").status_code == 401
        for tenant in ("acme", "beta"):
            _complete(client, _ids(7, 40), headers={"Authorization": f"Bearer {TENANT_KEYS[tenant]}"})
        text = client.get("/metrics", headers={"Authorization": f"Bearer {ADMIN_KEY}"}).text
    families = _families(text)
    assert _value(families, "kvgate_tenant_requests", tenant="acme") >= 1
    assert _value(families, "kvgate_tenant_requests", tenant="beta") >= 1
    assert _value(families, "kvgate_tenant_ttft_seconds_count", tenant="acme") >= 1
    tenants = {s.labels["tenant"] for s in families["kvgate_tenant_requests"].samples}
    assert tenants <= {"acme", "beta", "gamma"}  # names only: never a key
    assert "sk-" not in text


def test_random_paths_do_not_grow_the_prometheus_output(server) -> None:
    with httpx.Client(base_url=server.url, timeout=60) as client:
        client.get("/no/such/path")  # the unmatched bucket and the 404 status exist from here on
        client.get("/metrics")
        before = client.get("/metrics").text.count("\n")
        for i in range(200):
            client.get(f"/no/such/path/{i}")
        client.get("/metrics")
        after = client.get("/metrics").text.count("\n")
    assert after == before
