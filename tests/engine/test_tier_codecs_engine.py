"""A prefix served from a disk tier with a codec: with none, the cold run's tokens exactly; with
bf16 (lossy) the hit happens and the next-token distribution stays close."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.outputs import GenerateRequest
from engine.sampling_params import SamplingParams
from tests.engine.drive import outputs

BLOCK = 4
PROMPT_LEN = 121  # 30 full blocks + 1 token


def make_engine(model_dir: Path, **overrides: object) -> EngineCore:
    kwargs: dict[str, object] = dict(model=str(model_dir), block_size=BLOCK, num_blocks=64,
                                     max_num_batched_tokens=128, host_cache_mb=1)
    kwargs.update(overrides)
    return EngineCore(EngineConfig(**kwargs))  # type: ignore[arg-type]


def prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 1000) for _ in range(PROMPT_LEN)]


def run(core: EngineCore, request_id: str, ids: list[int]) -> tuple[list[int], list[dict[int, float]], int]:
    """Tokens, each step's top logprobs, and the cached prompt tokens of one greedy request."""
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=5)
    core.add_request(GenerateRequest(request_id, ids, params))
    tokens: list[int] = []
    tops: list[dict[int, float]] = []
    cached = -1
    for out in outputs(core):
        tokens.append(out.token_id)
        assert out.logprob is not None
        tops.append({out.token_id: out.logprob.logprob, **dict(out.logprob.top)})
        cached = out.num_cached_tokens if cached < 0 else cached
    return tokens, tops, cached


@pytest.mark.parametrize("codec", ["none", "bf16"])
def test_a_prefix_served_from_disk_with_a_codec(tiny_model_dir: Path, tmp_path: Path, codec: str) -> None:
    a = prompt(31)
    first = make_engine(tiny_model_dir, disk_cache_path=str(tmp_path / "kv"), disk_codec=codec)
    try:
        cold, cold_tops, cached = run(first, "a1", a)
        assert cached == 0
    finally:
        first.close()  # flushes the device and host blocks to disk, encoded
    sizes = {p.stat().st_size for p in (tmp_path / "kv").glob("*/*.kvb")}
    second = make_engine(tiny_model_dir, disk_cache_path=str(tmp_path / "kv"), disk_codec=codec)
    try:
        assert sizes == {second.block_format.record_size_of(codec)}
        warm, warm_tops, cached = run(second, "a2", a)
        disk = second.stats()["tiers"]["disk"]
        assert cached == 120 and disk["hits"] >= 30 and disk["codec"] == codec
        assert disk["bytes_read"] == disk["hits"] * second.block_format.record_size_of(codec)
        if codec == "none":  # lossless: the cold run's tokens (logprobs differ by float rounding, hit or
            assert warm == cold  # not: a hit prefills one token where the cold run prefilled 121)
            assert all(abs(cold_tops[0][t] - warm_tops[0][t]) < 1e-4 for t in cold_tops[0])
        else:  # lossy: the tokens may differ; the first step's top logprobs must stay close
            same = set(cold_tops[0]) & set(warm_tops[0])
            assert cold[0] in same
            assert all(abs(cold_tops[0][t] - warm_tops[0][t]) < 0.05 for t in same)
    finally:
        second.close()
