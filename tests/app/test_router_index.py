"""The router's index and score, from tables: a prefix held in memory beats one on disk beats
one in a shared store beats none, load weighs against it by the one knob, ties share the load, a
request's prompt leaves the load with its first answer byte, and the event feed applies batches
in order and clears (never guesses) when a gap cannot be filled; a stream a replica breaks off
ends with an error event and counts against it."""

from __future__ import annotations

import asyncio

import httpx
import msgpack
import pytest

from app.router.index import ReplicaIndex, choose, estimate
from app.router.relay import Router, _Load
from app.router.replicas import EventFeed, Replica

pytestmark = pytest.mark.unit


def h(i: int) -> bytes:
    return i.to_bytes(32, "big")


PROMPT = [h(i) for i in range(10)]  # 10 blocks of 16 tokens


def index(**media: range) -> ReplicaIndex:
    idx = ReplicaIndex()
    for medium, blocks in media.items():
        idx.stored(medium, [h(i) for i in blocks])
    return idx


@pytest.mark.parametrize("held, cached", [
    ({}, 0),
    ({"GPU": range(10)}, 160),
    ({"GPU": range(4), "CPU": range(4, 8)}, 128),  # memory, across two media
    ({"GPU": range(1, 10)}, 0),  # the first block is missing: nothing reusable
    ({"GPU": range(4), "DISK": range(10)}, 64 + 0.9 * 96),  # disk counts 0.9 of memory
    ({"REMOTE": range(10)}, 0),  # a shared store is the same for every replica
])
def test_cached_tokens(held: dict, cached: float) -> None:
    e = estimate(0, index(**held), PROMPT, 170, 16, outstanding=0, in_flight=0, load_weight=1.0)
    assert e.cached_tokens == pytest.approx(cached)
    assert e.cost == pytest.approx(170 - cached)


def test_the_prefix_wins_until_the_load_outweighs_it() -> None:
    warm, cold = index(GPU=range(10)), index()
    for load_weight, outstanding, winner in [(1.0, 0, 0), (1.0, 150, 0), (1.0, 170, 1), (0.0, 10_000, 0),
                                             (100.0, 2, 1)]:
        estimates = [estimate(0, warm, PROMPT, 170, 16, outstanding, 1, load_weight),
                     estimate(1, cold, PROMPT, 170, 16, 0, 0, load_weight)]
        assert choose(estimates).replica == winner, (load_weight, outstanding)


def test_a_prefix_another_replica_wrote_to_the_shared_store_counts_less_than_a_local_one() -> None:
    warm, cold = index(GPU=range(10)), index(DISK=range(2))
    peers = [warm, cold]  # both write through to the same store
    near = estimate(0, warm, PROMPT, 170, 16, 0, 0, 1.0, peers)
    far = estimate(1, cold, PROMPT, 170, 16, 0, 0, 1.0, peers)
    assert near.cached_tokens == 160
    assert far.cached_tokens == pytest.approx(0.9 * 32 + 0.85 * 128) and far.shared_blocks == 10
    assert estimate(1, cold, PROMPT, 170, 16, 0, 0, 1.0).cached_tokens == pytest.approx(0.9 * 32)  # no store
    # the gap is 0.15 of the prompt: a little load on the warm replica already sends it to the other
    assert choose([estimate(0, warm, PROMPT, 170, 16, 20, 1, 1.0, peers), far]).replica == 0
    assert choose([estimate(0, warm, PROMPT, 170, 16, 40, 1, 1.0, peers), far]).replica == 1


def test_a_request_weighs_its_prompt_until_answered_and_its_output_until_the_end() -> None:
    replica = Replica("http://r")
    load = _Load(replica, prompt=300, generate=64)
    assert (replica.outstanding, replica.in_flight) == (364, 1)
    load.answered()
    assert replica.outstanding == 64
    load.end()
    load.end()  # the stream's end and its cancellation both call it
    assert (replica.outstanding, replica.in_flight) == (0, 0)
    unanswered = _Load(replica, prompt=300, generate=64)
    unanswered.end()
    assert (replica.outstanding, replica.in_flight) == (0, 0)


class _BrokenOff(httpx.AsyncByteStream):
    """A replica's SSE answer that stops after its first two events (the process died)."""

    async def __aiter__(self):
        yield b'data: {"role": "assistant"}\n\n'
        yield b'data: {"text": "a"}\n\n'
        raise httpx.ReadError("connection reset by peer")


def test_a_stream_broken_off_mid_way_ends_with_an_error_event_and_is_counted() -> None:
    replica = Replica("http://r")
    response = httpx.Response(200, headers={"content-type": "text/event-stream"}, stream=_BrokenOff())

    async def relay() -> list[bytes]:
        return [chunk async for chunk in Router._stream(response, _Load(replica, prompt=30, generate=8), 2)]

    chunks = asyncio.run(relay())
    assert chunks[:2] == [b'data: {"role": "assistant"}\n\n', b'data: {"text": "a"}\n\n']
    assert b'"code": "replica_lost"' in chunks[2] and chunks[2].endswith(b"data: [DONE]\n\n")
    assert (replica.broken, replica.errors, replica.outstanding, replica.in_flight) == (1, 0, 0, 0)
    assert replica.snapshot()["broken"] == 1


def test_ties_go_to_fewer_in_flight_then_in_turn() -> None:
    empty = [estimate(i, index(), PROMPT, 170, 16, 0, 0, 1.0) for i in range(3)]
    assert [choose(empty, turn).replica for turn in range(4)] == [0, 1, 2, 0]
    busy = [estimate(0, index(), PROMPT, 170, 16, 0, 2, 1.0), estimate(1, index(), PROMPT, 170, 16, 0, 1, 1.0)]
    assert choose(busy, 0).replica == 1


def test_events_fold_into_the_index() -> None:
    idx = ReplicaIndex()
    idx.apply(["BlockStored", [h(1), h(2)], None, [], 16, None, "GPU"])
    idx.apply(["BlockRemoved", [h(1)], "GPU"])
    idx.apply(["BlockStored", [h(1)], None, [], 16, None, "CPU"])
    assert idx.blocks() == {"CPU": 1, "GPU": 1}
    idx.apply(["AllBlocksCleared"])
    assert idx.blocks() == {} and idx.clears == 1


def batch(*events: list) -> bytes:
    return msgpack.packb([1.0, list(events), None], use_bin_type=True)


def test_the_feed_applies_in_order_and_clears_on_a_gap_it_cannot_fill() -> None:
    replica = Replica("http://r")  # no replay endpoint: a gap cannot be filled
    feed = EventFeed(replica, ctx=None)  # type: ignore[arg-type]

    async def go() -> None:
        await feed.receive(0, batch(["AllBlocksCleared"], ["BlockStored", [h(1)], None, [], 16, None, "GPU"]))
        await feed.receive(1, batch(["BlockStored", [h(2)], h(1), [], 16, None, "GPU"]))
        assert replica.index.blocks() == {"GPU": 2} and replica.resets == 0
        await feed.receive(5, batch(["BlockStored", [h(9)], None, [], 16, None, "GPU"]))  # 2..4 lost
        assert replica.index.blocks() == {"GPU": 1} and replica.gaps == 1 and replica.resets == 1
        await feed.receive(0, batch(["AllBlocksCleared"]))  # the replica started again
        assert replica.index.blocks() == {} and replica.next_seq == 1
        await feed.receive(1, b"not msgpack")
        assert replica.resets == 3 and replica.next_seq == 2

    asyncio.run(go())
