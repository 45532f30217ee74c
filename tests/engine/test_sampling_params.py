"""SamplingParams: defaults, normalisation, and one rejected value per rule with its OpenAI param."""

from __future__ import annotations

import math

import pytest

from engine.errors import InvalidRequestError
from engine.sampling_params import SamplingParams


def test_defaults_are_valid_and_not_greedy() -> None:
    p = SamplingParams()
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.n) == (16, 1.0, 1.0, 0, 1)
    assert p.stop == [] and p.stop_token_ids == [] and p.logprobs is None
    assert not p.greedy and not p.has_penalties


@pytest.mark.parametrize("temperature, greedy", [(0, True), (0.0, True), (5e-6, True), (1e-5, False), (2, False)])
def test_greedy_threshold(temperature: float, greedy: bool) -> None:
    assert SamplingParams(temperature=temperature).greedy is greedy


def test_normalisation() -> None:
    p = SamplingParams(temperature=1, top_k=-1, stop="END", presence_penalty=1, logprobs=0)
    assert p.temperature == 1.0 and isinstance(p.temperature, float)
    assert p.top_k == 0 and p.stop == ["END"] and p.logprobs == 0
    assert p.has_penalties
    assert SamplingParams(repetition_penalty=1.1).has_penalties
    assert SamplingParams(frequency_penalty=-0.5).has_penalties


def test_accepted_boundaries() -> None:
    SamplingParams(max_tokens=1, temperature=2.0, top_p=1e-9, top_k=1, min_p=1.0, seed=-(2**63), n=16,
                   stop=["x"] * 16, stop_token_ids=[0, 5], presence_penalty=-2, frequency_penalty=2,
                   repetition_penalty=2.0, logprobs=20)
    SamplingParams(seed=2**64 - 1, min_p=0.0, repetition_penalty=1e-3)


@pytest.mark.parametrize(
    "kwargs, param",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"max_tokens": 3.0}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": 2.5}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"temperature": "1"}, "temperature"),
        ({"temperature": True}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.01}, "top_p"),
        ({"top_p": math.inf}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": 2.0}, "top_k"),
        ({"top_k": False}, "top_k"),
        ({"min_p": -0.01}, "min_p"),
        ({"min_p": 1.5}, "min_p"),
        ({"seed": 2**64}, "seed"),
        ({"seed": 1.5}, "seed"),
        ({"seed": False}, "seed"),
        ({"n": 0}, "n"),
        ({"n": 17}, "n"),
        ({"stop": ["a"] * 17}, "stop"),
        ({"stop": [""]}, "stop"),
        ({"stop": [3]}, "stop"),
        ({"stop": ("a",)}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"stop_token_ids": [True]}, "stop_token_ids"),
        ({"stop_token_ids": 5}, "stop_token_ids"),
        ({"ignore_eos": 1}, "ignore_eos"),
        ({"presence_penalty": 2.01}, "presence_penalty"),
        ({"presence_penalty": -math.inf}, "presence_penalty"),
        ({"frequency_penalty": -2.5}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"repetition_penalty": 2.1}, "repetition_penalty"),
        ({"logprobs": -1}, "top_logprobs"),
        ({"logprobs": 21}, "top_logprobs"),
        ({"logprobs": True}, "top_logprobs"),
    ],
)
def test_invalid_values_name_the_openai_param(kwargs: dict, param: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**kwargs)
    err = info.value
    assert err.param == param and err.status_code == 400
    assert err.message.startswith(param)


def test_message_states_range_and_value() -> None:
    with pytest.raises(InvalidRequestError, match=r"top_p must be > 0.0 and <= 1.0, got 1.5"):
        SamplingParams(top_p=1.5)
    with pytest.raises(InvalidRequestError, match=r"n must be between 1 and 16, got 17"):
        SamplingParams(n=17)
