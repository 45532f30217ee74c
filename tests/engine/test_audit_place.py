"""The isolation audit's engine-side operation (engine/cache_control.py, `place`): an audit
tenant's prefix is moved into one tier and out of every tier above it, as traffic would push it,
so that the audit can see that tier serve it; nobody else may use it. Against the real tiny
model: after each placement the lookup finds the prefix in that tier alone, and the same salt's
request reuses all of it with the cold run's tokens while another salt's reuses none."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from engine.cache_control import AUDIT_TENANT_PREFIX, CacheCommand, is_audit_tenant
from engine.core import EngineCore
from engine.outputs import GenerateRequest
from engine.sampling_params import SamplingParams
from tests.engine.drive import outputs
from tests.engine.test_cache_control import make_engine, prompt

AUDIT = AUDIT_TENANT_PREFIX + "a"
SALTS = {AUDIT: b"audit-salt-a", AUDIT_TENANT_PREFIX + "b": b"audit-salt-b", "acme": b"salt-of-acme"}


def run(core: EngineCore, request_id: str, ids: list[int], tenant: str = AUDIT) -> tuple[list[int], int]:
    core.add_request(GenerateRequest(request_id, ids, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True),
                                     namespace_salt=SALTS[tenant], tenant=tenant))
    tokens, cached = [], -1
    for out in outputs(core):
        tokens.append(out.token_id)
        cached = out.num_cached_tokens if cached < 0 else cached
    return tokens, cached


def control(core: EngineCore, op: str, ids: list[int] | None, tenant: str = AUDIT, **fields: Any) -> dict[str, Any]:
    answers: list[dict[str, Any]] = []
    core.cache_control(CacheCommand(op, tenant, SALTS[tenant], tuple(ids) if ids is not None else None, **fields),
                       answers.append)
    deadline = time.monotonic() + 20
    while not answers:
        assert time.monotonic() < deadline, f"no answer to {op}"
        core.poll_loads()
        time.sleep(0.001)
    return answers[0]


def test_only_audit_tenants_may_place_and_only_in_an_attached_tier(tiny_model_dir: Path) -> None:
    core = make_engine(tiny_model_dir)
    try:
        ids = prompt(1)
        run(core, "a1", ids)
        refused = control(core, "place", ids, tenant="acme", tier="host")
        assert refused["ok"] is False and refused["status"] == 403 and refused["code"] == "permission_denied"
        unknown = control(core, "place", ids, tier="disk")  # no disk tier here
        assert unknown["ok"] is False and unknown["status"] == 400 and unknown["param"] == "tier"
        assert control(core, "lookup", ids)["tiers"] == {"device": 120, "host": 0}  # nothing moved
        assert is_audit_tenant(AUDIT) and not is_audit_tenant("acme")
        with pytest.raises(ValueError, match="tier"):
            CacheCommand("place", AUDIT, b"s", (1,))
        with pytest.raises(ValueError, match="tier"):
            CacheCommand("lookup", AUDIT, b"s", (1,), tier="host")
        assert core.stats()["cache_control"]["requests"]["lookup"] == 0  # the audit's calls are not the API's
    finally:
        core.close()


def test_place_moves_a_prefix_down_tier_by_tier_and_only_its_salt_reuses_it(tiny_model_dir: Path, tmp_path: Path,
                                                                           redis_url: str) -> None:
    core = make_engine(tiny_model_dir, disk_cache_path=str(tmp_path / "kv"), remote_cache_url=redis_url)
    try:
        assert core.chain is not None
        for below in core.chain.tiers:  # loading is the engine's choice, never recomputing instead
            below.rate.bytes_per_s, below.rate.latency_s = 1e12, 0.0
        for seed, tier in enumerate(("device", "host", "disk", "remote"), 10):
            ids = prompt(seed)
            cold, _ = run(core, f"{tier}-cold", ids)
            placed = control(core, "place", ids, tier=tier)
            assert placed == {"ok": True, "tier": tier, "placed_blocks": 30, "skipped_in_use": 0}
            found = control(core, "lookup", ids)
            assert found["cached_tokens"] == found["tiers"][tier] == 120, (tier, found)
            assert run(core, f"{tier}-other", ids, tenant=AUDIT_TENANT_PREFIX + "b") == (cold, 0)
            assert run(core, f"{tier}-same", ids) == (cold, 120), tier
            for tenant in (AUDIT, AUDIT_TENANT_PREFIX + "b"):
                assert control(core, "delete", None, tenant=tenant)["ok"]
        core.check_invariants()
    finally:
        core.close()
