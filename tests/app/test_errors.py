"""Every error case returns its status and the OpenAI error shape; the server keeps serving."""

from __future__ import annotations

import httpx
import pytest

from tests.app.conftest import assert_error

CHAT = "/v1/chat/completions"
COMP = "/v1/completions"


def _chat(**extra) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **extra}


def _comp(**extra) -> dict:
    return {"model": "tiny", "prompt": "hi", "max_tokens": 2, **extra}


BAD_REQUESTS = [
    # (path, body, param)
    (COMP, _comp(temperature=5), "temperature"),
    (COMP, _comp(top_p=0), "top_p"),
    (COMP, _comp(n=0), "n"),
    (COMP, _comp(max_tokens=0), "max_tokens"),
    (COMP, _comp(logprobs=50), "logprobs"),
    (COMP, _comp(presence_penalty=3), "presence_penalty"),
    (COMP, _comp(echo=True), "echo"),
    (COMP, _comp(suffix="tail"), "suffix"),
    (COMP, _comp(logit_bias={"5": 1.0}), "logit_bias"),
    (COMP, _comp(prompt=""), "prompt"),
    (COMP, _comp(prompt=[]), "prompt"),
    (COMP, _comp(prompt=["ok", ""]), "prompt[1]"),
    (COMP, _comp(prompt=[1, 2, 10**6]), "prompt"),
    (COMP, _comp(prompt={"a": 1}), "prompt"),
    (COMP, _comp(cache_salt=""), "cache_salt"),
    (COMP, _comp(stream_options={"include_usage": True}), "stream_options"),
    (COMP, {"prompt": "no model"}, "model"),
    (CHAT, _chat(messages=[{"role": "tool", "content": "x"}]), "messages[0].role"),
    (CHAT, _chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
     "messages[0].content[0].type"),
    (CHAT, _chat(messages=[]), "messages"),
    (CHAT, _chat(messages="hello"), "messages"),
    (CHAT, _chat(top_logprobs=2), "top_logprobs"),
    (CHAT, _chat(max_completion_tokens=0), "max_completion_tokens"),
    (CHAT, _chat(tools=[{"type": "function", "function": {"name": "f"}}]), "tools"),
    (CHAT, _chat(temperature="hot"), "temperature"),
]


@pytest.mark.parametrize(("path", "body", "param"), BAD_REQUESTS, ids=[p for _, _, p in BAD_REQUESTS])
def test_invalid_values_are_400_naming_the_param(http: httpx.Client, path: str, body: dict, param: str) -> None:
    error = assert_error(http.post(path, json=body), 400, param=param)
    assert error["type"] == "invalid_request_error"


@pytest.mark.parametrize("content", [b'{"model": "tiny", "prompt": ', b"not json at all", b"[1, 2]", b""])
def test_malformed_json_is_400(http: httpx.Client, content: bytes) -> None:
    response = http.post(COMP, content=content, headers={"content-type": "application/json"})
    assert_error(response, 400)


def test_prompt_beyond_context_names_the_limits(http: httpx.Client) -> None:
    error = assert_error(http.post(COMP, json=_comp(max_tokens=5000)), 400, code="context_length_exceeded")
    assert "4096" in error["message"] and "5000" in error["message"]
    ids = list(range(10, 1000)) * 5  # 4950 prompt tokens
    error = assert_error(http.post(COMP, json=_comp(prompt=ids, max_tokens=None)), 400,
                         code="context_length_exceeded")
    assert "4096" in error["message"] and "4950" in error["message"]
    error = assert_error(http.post(CHAT, json=_chat(max_tokens=4096)), 400, code="context_length_exceeded")
    assert "4096" in error["message"]


def test_unknown_model_is_404(http: httpx.Client) -> None:
    assert_error(http.post(COMP, json=_comp(model="gpt-4")), 404, param="model", code="model_not_found")
    assert_error(http.post(CHAT, json=_chat(model="gpt-4")), 404, code="model_not_found")
    assert_error(http.get("/v1/models/gpt-4"), 404, code="model_not_found")


def test_unknown_route_and_method(http: httpx.Client) -> None:
    assert_error(http.get("/v1/nothing-here"), 404)
    assert_error(http.get(COMP), 405)


def test_body_too_large_is_413(http: httpx.Client) -> None:
    big = b'{"model": "tiny", "prompt": "' + b"a" * (5 * 1024 * 1024) + b'"}'
    response = http.post(COMP, content=big, headers={"content-type": "application/json"})
    assert_error(response, 413, code="request_too_large")

    def chunked():  # no Content-Length: the limit is enforced while reading
        for _ in range(5):
            yield b"a" * (1024 * 1024)

    response = http.post(COMP, content=chunked(), headers={"content-type": "application/json"})
    assert_error(response, 413, code="request_too_large")


def test_server_keeps_serving_after_errors(http: httpx.Client) -> None:
    for _ in range(3):
        http.post(COMP, content=b"{", headers={"content-type": "application/json"})
        http.post(COMP, json=_comp(temperature=9))
    response = http.post(COMP, json=_comp())
    assert response.status_code == 200 and response.json()["choices"][0]["finish_reason"] in ("stop", "length")
    assert http.get("/ready").status_code == 200
    assert http.get("/health").json() == {"status": "ok"}


def test_large_bodies_are_followed_by_one_malloc_trim(monkeypatch) -> None:
    """After requests with multi-MB bodies the freed memory goes back to the OS (once, shortly
    after the last one): without it eight 3.9 MB prompts left the server ~65 MB larger for good."""
    import asyncio

    from app import errors

    calls = []
    monkeypatch.setattr(errors, "release_freed_memory", lambda: calls.append(1))

    async def app(scope, receive, send) -> None:
        await receive()
        await send({"type": "http.response.start", "status": 400, "headers": []})
        await send({"type": "http.response.body", "body": b"no"})

    async def main() -> None:
        middleware = errors.BodySizeLimitMiddleware(app, max_bytes=8 << 20)
        transport = httpx.ASGITransport(app=middleware)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            await client.post("/", content=b"x" * 100)
            await asyncio.sleep(0.3)
            assert calls == []  # small bodies: nothing to give back
            await asyncio.gather(*(client.post("/", content=b"x" * (2 << 20)) for _ in range(4)))
            await asyncio.sleep(0.3)
            assert calls == [1]

    asyncio.run(main())
