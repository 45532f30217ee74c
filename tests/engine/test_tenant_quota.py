"""Flooding: a noisy tenant sending unique long prompts at full speed cannot push a quiet
tenant's hot prefix out of the device and host tiers once it has quotas there; the quiet tenant
keeps its hit rate. The control run (no quotas, same workload) shows the flood does evict it."""

from __future__ import annotations

import random
from pathlib import Path

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.outputs import GenerateRequest
from engine.sampling_params import SamplingParams

BLOCK = 16
HOT = 10 * BLOCK  # the quiet tenant's system prompt: 10 full blocks
QUOTA = {"device": 8, "host": 16}
ROUNDS = 4


def ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 1000) for _ in range(n)]


def serve(core: EngineCore, request_id: str, prompt: list[int], tenant: str, quota: dict[str, int]) -> int:
    """Run one request to its end; returns its cached prompt tokens."""
    core.add_request(GenerateRequest(request_id, prompt, SamplingParams(max_tokens=2, temperature=0, ignore_eos=True),
                                     namespace_salt=tenant.encode() * 4, tenant=tenant, quota=quota))
    cached = -1
    while core.has_work():
        for out in core.step():
            cached = out.num_cached_tokens if cached < 0 else cached
    return cached


def flood(model_dir: Path, quota: dict[str, int]) -> tuple[list[int], EngineCore]:
    """Quiet asks with its hot prefix after every burst of noisy's five 40-block unique prompts
    (200 blocks: more than the device and host tiers hold together)."""
    core = EngineCore(EngineConfig(model=str(model_dir), block_size=BLOCK, num_blocks=48, max_model_len=2048,
                                   max_num_batched_tokens=1024, host_cache_mb=1))  # host: 128 blocks
    hot = ids(1, HOT)
    serve(core, "quiet-0", hot + ids(2, 5), "quiet", {})
    hits = []
    for i in range(ROUNDS):
        for j in range(5):
            serve(core, f"noisy-{i}-{j}", ids(100 + 10 * i + j, 40 * BLOCK), "noisy", quota)
        hits.append(serve(core, f"quiet-{i + 1}", hot + ids(200 + i, 5), "quiet", {}))
        core.manager.check_invariants()
    return hits, core


def test_quotas_keep_the_quiet_tenants_prefix(tiny_model_dir: Path) -> None:
    hits, core = flood(tiny_model_dir, QUOTA)
    assert hits == [HOT] * ROUNDS
    pool, host = core.manager.pool.ledger, core.chain.memory.ledger
    assert pool.count("noisy") <= QUOTA["device"] and host.count("noisy") <= QUOTA["host"]
    assert pool.own_evictions > 0 and host.own_evictions > 0
    tiers = core.stats()["tiers"]
    assert tiers["host"]["quota"]["limits"] == {"noisy": QUOTA["host"]}


def test_without_quotas_the_flood_evicts_it(tiny_model_dir: Path) -> None:
    hits, _ = flood(tiny_model_dir, {})
    assert hits == [0] * ROUNDS
