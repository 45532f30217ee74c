"""A client that disconnects, streaming or not, leaves no KV block allocated."""

from __future__ import annotations

import httpx

from tests.app.conftest import wait_for_idle

LONG = {"model": "tiny", "prompt": "tell me a long story " * 20, "max_tokens": 3000, "ignore_eos": True}


def test_stream_disconnect_frees_blocks(http: httpx.Client) -> None:
    with http.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as response:
        lines = 0
        for line in response.iter_lines():
            lines += bool(line)
            if lines >= 3:
                break
    during = http.get("/admin/metrics").json()
    metrics = wait_for_idle(http)
    assert metrics["blocks_in_use"] == 0, (during, metrics)
    assert metrics["requests"]["client_disconnects"] >= 1


def test_chat_stream_disconnect_frees_blocks(http: httpx.Client) -> None:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "go on " * 40}], "max_tokens": 3000,
            "ignore_eos": True, "stream": True, "n": 2}
    with http.stream("POST", "/v1/chat/completions", json=body) as response:
        next(response.iter_lines())
    assert wait_for_idle(http)["blocks_in_use"] == 0


def test_non_streaming_disconnect_frees_blocks(server, http: httpx.Client) -> None:
    try:
        httpx.post(server.url + "/v1/completions", json={**LONG, "prompt": ["a " * 30, "b " * 30]}, timeout=0.5)
    except httpx.TimeoutException:
        pass
    else:
        raise AssertionError("a 3000-token completion should outlast a 0.5 s timeout")
    assert wait_for_idle(http)["blocks_in_use"] == 0
    assert http.post("/v1/completions", json={"model": "tiny", "prompt": "ok", "max_tokens": 2}).status_code == 200
