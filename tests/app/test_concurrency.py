"""Concurrent streams are served together (continuous batching), shown by order, not speed."""

from __future__ import annotations

import asyncio
import json

import httpx

from tests.app.conftest import wait_for_idle

NUM_REQUESTS = 32
MAX_TOKENS = 16


async def _stream(client: httpx.AsyncClient, body: dict, events: list[tuple[str, str]], name: str,
                  stop_after: int | None = None) -> tuple[str, str | None, int]:
    """Stream one completion, appending (name, "chunk"|"end") to the shared `events` in arrival order."""
    text, finish, chunks = [], None, 0
    async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                break
            choice = json.loads(line[6:])["choices"][0]
            events.append((name, "chunk"))
            chunks += 1
            text.append(choice["text"])
            finish = choice["finish_reason"] or finish
            if stop_after is not None and chunks >= stop_after:
                break  # disconnect: the server aborts the rest
    events.append((name, "end"))
    return "".join(text), finish, chunks


def test_32_concurrent_streams_all_complete(server) -> None:
    events: list[tuple[str, str]] = []

    async def main() -> list[tuple[str, str | None, int]]:
        limits = httpx.Limits(max_connections=NUM_REQUESTS)
        async with httpx.AsyncClient(base_url=server.url, timeout=120, limits=limits) as client:
            return await asyncio.gather(*(
                _stream(client, {"model": "tiny", "prompt": f"request {i}: the numbers are",
                                 "max_tokens": MAX_TOKENS, "temperature": 0.7, "seed": i, "ignore_eos": True},
                        events, str(i))
                for i in range(NUM_REQUESTS)))

    results = asyncio.run(main())
    assert all(finish == "length" for _, finish, _ in results)
    assert sum(chunks for _, _, chunks in results) == NUM_REQUESTS * MAX_TOKENS
    with httpx.Client(base_url=server.url) as client:
        assert wait_for_idle(client)["blocks_in_use"] == 0


def test_a_short_stream_completes_while_a_long_one_streams(server) -> None:
    """A server that served one request at a time would finish the long stream first.

    The long stream (1,000 tokens) has started before the short one (4 tokens) is sent; the short
    one must end while the long one still streams. Only the order of events is asserted.
    """
    events: list[tuple[str, str]] = []
    base = {"model": "tiny", "temperature": 0, "ignore_eos": True}

    async def main() -> None:
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
            long_task = asyncio.create_task(_stream(
                client, {**base, "prompt": "a long story", "max_tokens": 1000}, events, "long", stop_after=None))
            while ("long", "chunk") not in events:
                await asyncio.sleep(0.005)
            short = await _stream(client, {**base, "prompt": "short", "max_tokens": 4}, events, "short")
            assert short[1] == "length" and short[2] == 4
            # the long stream keeps streaming after the short one ended; then we hang up on it
            seen = len(events)
            while sum(1 for name, _ in events[seen:] if name == "long") < 3 and not long_task.done():
                await asyncio.sleep(0.005)
            long_task.cancel()
            try:
                await long_task
            except asyncio.CancelledError:
                pass

    asyncio.run(main())
    short_end = events.index(("short", "end"))
    assert ("long", "end") not in events[:short_end], "the long stream finished before the short one"
    assert events[short_end + 1:].count(("long", "chunk")) >= 3, events[-10:]
    with httpx.Client(base_url=server.url) as client:
        assert wait_for_idle(client)["blocks_in_use"] == 0
