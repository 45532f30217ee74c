"""RequestLimits: what any process can check about a request before the engine sees it."""

from __future__ import annotations

import pytest

from engine.errors import InvalidRequestError
from engine.limits import RequestLimits
from engine.outputs import GenerateRequest
from engine.sampling_params import SamplingParams

LIMITS = RequestLimits(vocab_size=100, max_model_len=512, block_size=16, num_blocks=64)


def _request(prompt_len: int = 20, max_tokens: int = 10, n: int = 1, **extra) -> GenerateRequest:
    return GenerateRequest(request_id="r", prompt_token_ids=[1] * prompt_len,
                           params=SamplingParams(max_tokens=max_tokens, n=n), **extra)


def test_worst_case_blocks_shares_full_prompt_blocks_between_siblings() -> None:
    # 40 prompt tokens: 2 full blocks shared; each sequence's own: block 3 (8 prompt + 8 output) .. token 60
    assert LIMITS.worst_case_blocks(40, 20, 1) == 4
    assert LIMITS.worst_case_blocks(40, 20, 3) == 2 + 3 * 2
    assert LIMITS.worst_case_blocks(32, 1, 4) == 2 + 4 * 1


def test_a_job_whose_sequences_cannot_all_fit_is_refused() -> None:
    LIMITS.validate_job([_request(32, 100, n=8)])  # 2 + 8 × 7 = 58 blocks of 64
    with pytest.raises(InvalidRequestError) as info:
        LIMITS.validate_job([_request(32, 100, n=8), _request(32, 100, n=1)])
    assert info.value.code == "request_too_large" and "67 KV blocks" in info.value.message


def test_cache_salt_must_be_valid_unicode() -> None:
    with pytest.raises(InvalidRequestError) as info:
        LIMITS.validate(_request(cache_salt="\ud800"))
    assert info.value.param == "cache_salt"
    LIMITS.validate(_request(cache_salt="ok ✓"))


@pytest.mark.parametrize("bad", [-1, 100, 2.0, "7", 2**70])
def test_prompt_ids_must_be_integers_in_the_vocabulary(bad: object) -> None:
    request = GenerateRequest(request_id="r", prompt_token_ids=[1, 2, bad], params=SamplingParams())  # type: ignore[list-item]
    with pytest.raises(InvalidRequestError) as info:
        LIMITS.validate(request)
    assert info.value.param == "prompt" and repr(bad) in info.value.message
