"""32 concurrent streaming requests all complete, their tokens interleaved in time."""

from __future__ import annotations

import asyncio
import json

import httpx

from tests.app.conftest import wait_for_idle

NUM_REQUESTS = 32
MAX_TOKENS = 16


async def _stream(client: httpx.AsyncClient, i: int, arrivals: list[int]) -> tuple[str, str | None]:
    body = {"model": "tiny", "prompt": f"request {i}: the numbers are", "max_tokens": MAX_TOKENS,
            "temperature": 0.7, "seed": i, "ignore_eos": True, "stream": True}
    text, finish = [], None
    async with client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                break
            choice = json.loads(line[6:])["choices"][0]
            arrivals.append(i)
            text.append(choice["text"])
            finish = choice["finish_reason"] or finish
    return "".join(text), finish


def test_32_concurrent_streams_interleave(server) -> None:
    arrivals: list[int] = []  # request index of every chunk, in arrival order

    async def main() -> list[tuple[str, str | None]]:
        limits = httpx.Limits(max_connections=NUM_REQUESTS)
        async with httpx.AsyncClient(base_url=server.url, timeout=120, limits=limits) as client:
            return await asyncio.gather(*(_stream(client, i, arrivals) for i in range(NUM_REQUESTS)))

    results = asyncio.run(main())
    assert all(finish == "length" for _, finish in results)
    assert len(arrivals) == NUM_REQUESTS * MAX_TOKENS
    # Continuous batching seen from outside: while one request streams, others stream too.
    spans = {i: (arrivals.index(i), len(arrivals) - 1 - arrivals[::-1].index(i)) for i in range(NUM_REQUESTS)}
    overlapping = sum(1 for i, (lo, hi) in spans.items()
                      if any(j != i and lo < spans[j][0] < hi for j in spans)
                      or any(j != i and spans[j][0] < lo < spans[j][1] for j in spans))
    switches = sum(1 for a, b in zip(arrivals, arrivals[1:], strict=False) if a != b)
    assert overlapping >= NUM_REQUESTS - 2, spans
    assert switches > 4 * NUM_REQUESTS, switches
    with httpx.Client(base_url=server.url) as client:
        assert wait_for_idle(client)["blocks_in_use"] == 0
