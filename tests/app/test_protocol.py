"""Request models → SamplingParams, and validation-error params, without a server."""

from __future__ import annotations

import pytest

from app.errors import _param_from_loc
from app.protocol import ChatCompletionRequest, CompletionRequest, DeltaMessage
from engine.errors import InvalidRequestError


def test_completion_params() -> None:
    request = CompletionRequest(model="m", prompt="x", stop="\n", top_k=-1, temperature=0, seed=3, logprobs=2)
    params = request.sampling_params(default_max_tokens=100)
    assert (params.max_tokens, params.stop, params.top_k, params.seed, params.logprobs) == (16, ["\n"], 0, 3, 2)
    assert params.greedy
    assert CompletionRequest(model="m", prompt="x", max_tokens=None).sampling_params(100).max_tokens == 100


def test_chat_params() -> None:
    request = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}],
                                    max_tokens=5, max_completion_tokens=7, logprobs=True, top_logprobs=3)
    params = request.sampling_params(default_max_tokens=100)
    assert (params.max_tokens, params.logprobs) == (7, 3)
    plain = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}])
    assert plain.sampling_params(default_max_tokens=100).max_tokens == 100
    assert plain.sampling_params(default_max_tokens=100).logprobs is None


@pytest.mark.parametrize(("request_", "param"), [
    (CompletionRequest(model="m", prompt="x", logprobs=21), "logprobs"),
    (ChatCompletionRequest(model="m", messages=[], max_completion_tokens=0), "max_completion_tokens"),
    (ChatCompletionRequest(model="m", messages=[], repetition_penalty=0), "repetition_penalty"),
])
def test_params_named_as_the_client_sent_them(request_, param: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        request_.sampling_params(default_max_tokens=10)
    assert info.value.param == param


def test_param_from_loc() -> None:
    assert _param_from_loc(("body", "messages", 0, "content", 1, "type")) == "messages[0].content[1].type"
    assert _param_from_loc(("body", "prompt", "list[int]", 2)) == "prompt[2]"
    assert _param_from_loc(("body",)) is None


def test_delta_drops_empty_fields() -> None:
    assert DeltaMessage().model_dump() == {}
    assert DeltaMessage(role="assistant", content="").model_dump() == {"role": "assistant", "content": ""}
