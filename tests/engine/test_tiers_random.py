"""A seeded random workload over the whole chain (device → host → disk): shared prefixes, floods,
aborts, host flushes and restarts. After every request the accounting holds everywhere and every
greedy output equals the output computed with no cache at all."""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.outputs import GenerateRequest
from engine.sampling_params import SamplingParams

BLOCK = 4
PREFIXES = [[random.Random(s).randrange(3, 1000) for _ in range(48)] for s in range(4)]


def _engine(model_dir: Path, disk: Path | None, **kw) -> EngineCore:
    return EngineCore(EngineConfig(model=str(model_dir), block_size=BLOCK, num_blocks=40, max_num_batched_tokens=64,
                                   host_cache_mb=kw.pop("host_mb", 1), disk_cache_path=str(disk) if disk else None,
                                   disk_cache_mb=1, **kw))


def _run(core: EngineCore, rid: str, ids: list[int], abort_after: int | None = None) -> list[int]:
    core.add_request(GenerateRequest(rid, ids, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)))
    tokens: list[int] = []
    for _ in range(200_000):
        if not (core.has_work() or core.is_loading()):
            break
        if abort_after is not None and core.counters.steps >= abort_after:
            core.abort_request(rid)
            abort_after = None
            continue
        core.poll_loads()
        if not core.has_work():
            time.sleep(0.0005)
            continue
        tokens += [o.token_id for o in core.step() if o.request_id == rid]
    return tokens


def _check(core: EngineCore) -> None:
    core.check_invariants()  # the manager's, the host tier's, and one owner per storage row
    chain = core.chain
    if chain.memory is not None:
        assert len(chain.memory) <= chain.memory.capacity_blocks
    if chain.store is not None:
        chain.drain_writes(10)
        chain.store.check_invariants()
    assert core.manager.num_blocks_in_use == 0 and not core.is_loading()


ops = st.lists(st.tuples(st.sampled_from(["request", "abort", "flood", "flush_host", "restart"]),
                         st.integers(0, 3), st.integers(1, 20)), min_size=4, max_size=12)


@pytest.mark.parametrize("share", [True, False], ids=["host-shares-the-slab", "host-copies"])
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops)
def test_random_workload_keeps_the_chain_consistent_and_outputs_exact(tiny_model_dir: Path, tmp_path_factory,
                                                                       share: bool, script) -> None:
    disk = tmp_path_factory.mktemp("kv")
    reference = _engine(tiny_model_dir, None, host_mb=0, enable_prefix_caching=False)
    core = _engine(tiny_model_dir, disk, share_host_slab=share)
    expected: dict[tuple[int, int], list[int]] = {}
    try:
        for n, (op, which, extra) in enumerate(script):
            ids = PREFIXES[which] + [3 + extra] * 5
            key = (which, extra)
            if key not in expected:
                expected[key] = _run(reference, f"ref{n}", ids)
            if op == "request":
                assert _run(core, f"r{n}", ids) == expected[key]
            elif op == "abort":
                _run(core, f"a{n}", ids, abort_after=core.counters.steps + extra % 3)
            elif op == "flood":
                _run(core, f"f{n}", [random.Random(n * 31 + extra).randrange(3, 1000) for _ in range(150)])
            elif op == "flush_host":
                core.chain.flush([], timeout_s=10)
                core.chain.memory.clear()
            elif op == "restart":
                core.close()
                core = _engine(tiny_model_dir, disk, share_host_slab=share)
            _check(core)
    finally:
        core.close()
        reference.close()
