"""`min_tokens` (vLLM's extension, sent by the shared load client): EOS and stop_token_ids cannot
end a choice before that many tokens; the sampler masks them, so they are never emitted early."""

from __future__ import annotations

from pathlib import Path

import pytest

from app.protocol import CompletionRequest
from engine.errors import InvalidRequestError
from engine.sampling_params import SamplingParams
from tests.engine.test_core import make_engine, run_all

PROMPT = [5, 17, 42, 9, 300, 12, 77, 8]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_stop_token_cannot_end_the_choice_before_min_tokens(tiny_model_dir: Path, temperature: float) -> None:
    core = make_engine(tiny_model_dir)
    first = run_all(core, [PROMPT], SamplingParams(max_tokens=1, temperature=0.0))["r0"][0]
    stop_early = SamplingParams(max_tokens=8, temperature=0.0, stop_token_ids=[first])
    assert run_all(core, [PROMPT], stop_early)["r0"] == [first]  # without min_tokens: one token, stop
    params = SamplingParams(max_tokens=8, temperature=temperature, seed=1, stop_token_ids=[first], min_tokens=5)
    tokens = run_all(core, [PROMPT], params)["r0"]
    assert len(tokens) >= 5 and first not in tokens[:5]
    assert len(tokens) == 8 or tokens[-1] == first  # after min_tokens the stop token ends it again


def test_min_tokens_is_checked_like_the_other_fields() -> None:
    assert CompletionRequest(model="m", prompt="x", min_tokens=3).sampling_params(10).min_tokens == 3
    for bad, message in ((17, "must not exceed max_tokens"), (-1, "min_tokens")):
        with pytest.raises(InvalidRequestError) as info:
            CompletionRequest(model="m", prompt="x", min_tokens=bad).sampling_params(10)
        assert info.value.param == "min_tokens" and message in info.value.message
