"""Randomised engine runs: arrivals, aborts, n > 1 and preemption on a tiny pool never leak or corrupt."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.outputs import GenerateRequest
from engine.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def engine(tiny_model_dir) -> EngineCore:
    return EngineCore(EngineConfig(model=str(tiny_model_dir), block_size=4, num_blocks=24,
                                   max_num_batched_tokens=24, max_num_seqs=6))


def _live(engine: EngineCore) -> dict:
    live = {}
    for seq in list(engine.scheduler.running) + list(engine.scheduler.waiting):
        live[seq.seq_id] = (seq.root_hash, seq.token_ids[: seq.num_computed_tokens])
    return live


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**32 - 1))
def test_random_workload_keeps_invariants(engine, seed):
    rng = random.Random(seed)
    alphabet = [5, 6, 7, 8]  # few distinct tokens so prefixes collide and hit the cache
    expected_tokens: dict[str, int] = {}
    produced: dict[str, int] = {}
    aborted: set[str] = set()
    counter = 0
    for _ in range(60):
        if rng.random() < 0.4:
            rid = f"{seed}-{counter}"
            counter += 1
            n = rng.choice([1, 1, 2])
            max_tokens = rng.randint(1, 10)
            prompt = [rng.choice(alphabet) for _ in range(rng.randint(1, 30))]
            params = SamplingParams(max_tokens=max_tokens, n=n, temperature=rng.choice([0.0, 1.0]),
                                    seed=rng.randint(0, 99), ignore_eos=True)
            engine.add_request(GenerateRequest(rid, prompt, params, namespace_salt=rng.choice([b"a", b"b"])))
            expected_tokens[rid] = max_tokens * n
            produced[rid] = 0
        if produced and rng.random() < 0.1:
            victim = rng.choice(sorted(produced))
            if engine.abort_request(victim):
                aborted.add(victim)
        for out in engine.step():
            produced[out.request_id] += 1
        engine.manager.check_invariants(_live(engine))
    while engine.has_work():
        for out in engine.step():
            produced[out.request_id] += 1
        engine.manager.check_invariants(_live(engine))
    assert engine.manager.num_blocks_in_use == 0
    assert engine.num_requests == 0
    for rid, count in produced.items():
        if rid not in aborted:
            assert count == expected_tokens[rid], rid
