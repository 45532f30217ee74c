"""The isolation self-test over HTTP (`POST /admin/audit`, docs/audit.md), against an in-process
server with host, disk and a private Redis attached: every tier passes with exact figures, only
the admin key runs or reads it, one runs at a time, nothing of it is left in any tier or in
Redis while a tenant's prefix and figures stay as they were, and an isolation broken on purpose
(both salts the same) is caught. One audit also runs through `kvgate serve`'s engine process."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

import app.audit
from cache.hashing import extend_block_hashes, root_hash
from tenants.registry import TenantSpec
from tests.app.conftest import assert_error

ADMIN_KEY = "admin-key-audit"
KEYS = {"acme": "sk-acme-audit"}
CONFIG = f"""
[model]
path = "tiny"

[server]
secret = "tests-only-server-secret-0123456789"

[cache]
block_size = 16

[cache.device]
num_blocks = 128

[cache.host]
capacity_mb = 2

[admin]
api_key = "{ADMIN_KEY}"

[[tenants]]
name = "acme"
api_keys = ["{KEYS['acme']}"]
"""
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
ACME = {"Authorization": f"Bearer {KEYS['acme']}"}
TIERS = ["device", "host", "disk", "remote"]
PROBE_TOKENS = 512  # the audit's prompts: 32 full blocks of 16, then half a block


@pytest.fixture(scope="module")
def app_server(start_app, redis_server) -> Iterator[Any]:
    with redis_server.client() as client:
        client.flushall()
    server = start_app("--remote-cache", redis_server.url, config=CONFIG)
    yield server
    server.stop()
    with redis_server.client() as client:
        client.flushall()


def audit(server: Any, body: dict[str, Any] | None = None, headers: dict[str, str] | None = None) -> httpx.Response:
    return httpx.post(server.url + "/admin/audit", json=body, headers=ADMIN if headers is None else headers,
                      timeout=300)


def metrics(server: Any) -> dict[str, Any]:
    return httpx.get(server.url + "/admin/metrics", headers=ADMIN, timeout=30).json()


def why(report: dict[str, Any]) -> str:
    """A failed report in a line: each tier's failures, the control, the cleanup, the error."""
    tiers = {name: t["failures"] for name, t in report["tiers"].items() if t["failures"]}
    return f"tiers {tiers}; control {report['control']}; cleanup {report['cleanup']}; error {report['error']}"


def redis_keys(redis_server: Any) -> set[bytes]:
    with redis_server.client() as client:
        return set(client.keys("*"))


def acme_prompt() -> list[int]:
    rng = random.Random(7)
    return [rng.randrange(3, 1000) for _ in range(161)]  # 10 full blocks


def acme_lookup(server: Any, prompt: list[int]) -> int:
    found = httpx.post(server.url + "/v1/cache/lookup", json={"prompt": prompt}, headers=ACME, timeout=30)
    assert found.status_code == 200, found.text
    return int(found.json()["cached_tokens"])


def settle_writes(server: Any) -> None:
    deadline = time.monotonic() + 10
    while metrics(server)["tiers"]["chain"]["pending_writes"] and time.monotonic() < deadline:
        time.sleep(0.02)


def test_the_audit_passes_on_every_tier_leaves_nothing_and_touches_no_tenant(app_server: Any,
                                                                            redis_server: Any) -> None:
    prompt = acme_prompt()
    done = httpx.post(app_server.url + "/v1/completions", headers=ACME, timeout=60,
                      json={"model": "tiny", "prompt": prompt, "max_tokens": 2, "temperature": 0})
    assert done.status_code == 200, done.text
    settle_writes(app_server)
    engine = app_server.app.state.engine
    salt = app_server.app.state.registry.get("acme").salt
    prefix = f"kvgate:{engine.fingerprint.hex()}:".encode()
    acme_keys = {prefix + h.hex().encode() for h in extend_block_hashes([], root_hash(salt, engine.fingerprint),
                                                                        prompt, 16)}
    keys_before = redis_keys(redis_server)
    assert acme_keys <= keys_before
    before = metrics(app_server)

    started = time.perf_counter()
    response = audit(app_server)
    took = time.perf_counter() - started
    assert response.status_code == 200, response.text
    report = response.json()
    print(f"\naudit of {', '.join(report['tiers'])} took {took:.1f} s over HTTP ({report['duration_s']} s inside, "
          f"{report['requests']} requests)")
    assert report["passed"] and report["error"] is None, why(report)
    assert list(report["tiers"]) == TIERS  # every attached tier, top down
    for name, tier in report["tiers"].items():
        assert tier["passed"] and tier["failures"] == [], (name, tier)  # (via a request, or a prefetch: below)
        assert tier["placed_tokens"] == tier["expected_tokens"] == PROBE_TOKENS, (name, tier)
        assert tier["same_salt_hit_tokens"] == PROBE_TOKENS, (name, tier)
        assert tier["other_salt_hit_tokens"] == 0 and tier["other_salt_lookup_tokens"] == 0, (name, tier)
        assert tier["quiet"], (name, tier)  # nothing else ran: the counters are exact
        assert tier["same_salt_counter_deltas"][name] == 32, (name, tier)  # served by this very tier
        assert set(tier["other_salt_counter_deltas"].values()) == {0}, (name, tier)
        assert tier["ks"]["passed"] and tier["ks"]["p"] > 0.01 and tier["ks"]["samples"] == 24, (name, tier)
    assert report["control"]["passed"] and report["control"]["p"] < 0.01
    assert report["control"]["median_s"][0] < report["control"]["median_s"][1]  # hits are faster than misses
    assert report["cleanup"]["remaining_tokens"] == 0 and report["cleanup"]["checked_prompts"] > 4 * 24
    assert report["requests"] > 4 * 24 * 3 and report["samples"] == 24 and report["prompt_tokens"] == 520

    # the last report, as GET has it (the dashboard's source)
    status = httpx.get(app_server.url + "/admin/audit", headers=ADMIN).json()
    assert status == {"running": False, "last": report}

    # nothing of the audit is left: Redis holds exactly what it held (acme's blocks and account)
    settle_writes(app_server)
    assert redis_keys(redis_server) == keys_before
    # the tenant's prefix is still cached, and no tenant figure counted the audit
    assert acme_lookup(app_server, prompt) == 160
    after = metrics(app_server)
    assert after["requests"]["tenants"].keys() == before["requests"]["tenants"].keys() == {"acme"}
    assert after["requests"]["tenants"]["acme"]["requests"] == before["requests"]["tenants"]["acme"]["requests"]
    assert after["cache_control"]["requests"]["lookup"] == before["cache_control"]["requests"]["lookup"] + 1
    assert after["cache_control"]["requests"]["delete"] == before["cache_control"]["requests"]["delete"]
    assert not [t for t in after["tenant_usage"] if t.startswith("kvgate:audit:")]
    assert after["requests_added"] - before["requests_added"] == report["requests"]


def test_only_the_admin_key_runs_or_reads_the_audit(app_server: Any) -> None:
    for headers in (ACME, {}, {"Authorization": "Bearer sk-nope"}):
        assert_error(audit(app_server, {"tiers": ["device"], "samples": 8}, headers=headers), 401)
        assert_error(httpx.get(app_server.url + "/admin/audit", headers=headers), 401)


def test_a_second_audit_while_one_runs_is_a_409(app_server: Any) -> None:
    first: list[httpx.Response] = []
    runner = threading.Thread(target=lambda: first.append(audit(app_server, {"tiers": ["device"], "samples": 12})))
    runner.start()
    deadline = time.monotonic() + 30
    while not httpx.get(app_server.url + "/admin/audit", headers=ADMIN).json()["running"]:
        assert time.monotonic() < deadline and runner.is_alive(), "the first audit never showed as running"
        time.sleep(0.005)
    assert_error(audit(app_server, {"tiers": ["device"], "samples": 8}), 409, code="audit_running")
    runner.join(120)
    assert first and first[0].status_code == 200, first
    report = first[0].json()
    assert report["passed"], why(report)
    assert list(report["tiers"]) == ["device"] and report["tiers"]["device"]["ks"]["samples"] == 12
    assert audit(app_server, {"tiers": ["device"], "samples": 8}).status_code == 200  # and then another may run


@pytest.mark.parametrize(("body", "param"), [
    ({"tiers": ["nvme"]}, "tiers"),
    ({"tiers": []}, "tiers"),
    ({"tiers": "device"}, "tiers"),
    ({"samples": 3}, "samples"),
    ({"samples": 100_000}, "samples"),
    ({"samples": "24"}, "samples"),
    ({"samples": 8, "extra": 1}, "extra"),
])
def test_bad_input_is_a_400_naming_the_field(app_server: Any, body: dict[str, Any], param: str) -> None:
    error = assert_error(audit(app_server, body), 400, param=param)
    assert error["type"] == "invalid_request_error"


@pytest.mark.parametrize("slow_disk", [False, True])
def test_a_broken_isolation_is_caught(app_server: Any, monkeypatch: pytest.MonkeyPatch, slow_disk: bool) -> None:
    """Both synthetic salts the same, as a salt derivation that ignored the namespace would give;
    also where the disk looks slower than recomputing, so a request alone would not ask it."""
    real = app.audit.audit_salts
    monkeypatch.setattr(app.audit, "audit_salts", lambda secret, nonce: (real(secret, nonce)[0],) * 2)
    if slow_disk:
        rate = app_server.app.state.engine.backend.core.chain.store.rate
        monkeypatch.setattr(rate, "bytes_per_s", 1.0)
        monkeypatch.setattr(rate, "latency_s", 60.0)
    response = audit(app_server, {"tiers": ["device", "disk"], "samples": 8})
    assert response.status_code == 200, response.text
    report = response.json()
    assert report["passed"] is False and report["error"] is None
    for name in ("device", "disk"):
        tier = report["tiers"][name]
        assert tier["passed"] is False and tier["other_salt_hit_tokens"] == PROBE_TOKENS, (name, tier)
        assert tier["other_salt_lookup_tokens"] == PROBE_TOKENS
        assert any("another salt reused 512 tokens" in why for why in tier["failures"]), tier["failures"]
    assert report["cleanup"]["remaining_tokens"] == 0  # cleaned up all the same
    status = httpx.get(app_server.url + "/admin/audit", headers=ADMIN).json()
    assert status["last"]["passed"] is False


def test_a_tier_the_engine_would_not_load_from_is_asked_through_a_prefetch(app_server: Any) -> None:
    """The disk looks slower than recomputing: a request recomputes instead of asking it, so the
    audit asks the tier as a cache prefetch does (which loads regardless), then the request."""
    disk = app_server.app.state.engine.backend.core.chain.store
    rate = (disk.rate.bytes_per_s, disk.rate.latency_s)
    disk.rate.bytes_per_s, disk.rate.latency_s = 1.0, 60.0
    try:
        report = audit(app_server, {"tiers": ["disk"], "samples": 8}).json()
    finally:
        disk.rate.bytes_per_s, disk.rate.latency_s = rate
    tier = report["tiers"]["disk"]
    assert tier["same_salt_via"] == "prefetch" and tier["same_salt_hit_tokens"] == PROBE_TOKENS, tier
    assert tier["same_salt_counter_deltas"]["disk"] == 32 and tier["other_salt_hit_tokens"] == 0, tier
    assert tier["passed"] and report["passed"], why(report)


def test_the_routes_are_documented_and_the_dashboard_shows_the_last_audit(app_server: Any) -> None:
    schema = httpx.get(app_server.url + "/openapi.json", headers=ADMIN).json()
    post, get = schema["paths"]["/admin/audit"]["post"], schema["paths"]["/admin/audit"]["get"]
    assert post["tags"] == get["tags"] == ["admin"] and post["description"] and get["description"]
    assert "AuditReport" in schema["components"]["schemas"] and "AuditRequest" in schema["components"]["schemas"]
    assert post["responses"]["200"]["content"]["application/json"]["schema"]["$ref"].endswith("/AuditReport")
    page = httpx.get(app_server.url + "/admin").text
    script = httpx.get(app_server.url + "/admin/static/dashboard.js").text
    assert 'id="audit-tiers"' in page and 'fetch("/admin/audit"' in script


def test_no_tenant_can_be_named_as_the_audit() -> None:
    with pytest.raises(ValueError, match="invalid"):
        TenantSpec("kvgate:audit:a", ("sk-x",))


def test_the_audit_runs_through_the_engine_process(server: Any) -> None:
    """`kvgate serve` (an engine process; host and a disk folder), no keys configured: the place
    operation, lookups and deletes cross the process boundary as the requests do."""
    response = httpx.post(server.url + "/admin/audit", json={"tiers": ["device", "disk"]}, timeout=300)
    assert response.status_code == 200, response.text
    report = response.json()
    assert report["passed"], why(report)
    assert list(report["tiers"]) == ["device", "disk"] and report["tiers"]["disk"]["placed_tokens"] == PROBE_TOKENS
    assert report["cleanup"]["remaining_tokens"] == 0
