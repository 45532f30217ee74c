"""The event log: order kept across producers, runs merged without changing what a subscriber
folds, a bounded queue that resyncs (AllBlocksCleared) instead of blocking, and the pool's
stores and evictions announced as they happen."""

from __future__ import annotations

import threading

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cache.block_pool import BlockPool
from cache.events import CLEARED, REMOVED, STORED, Event, EventLog, MediumEvents, merge

pytestmark = pytest.mark.unit


def h(i: int) -> bytes:
    return i.to_bytes(32, "big")


def fold(events: list[Event]) -> dict[str, list[bytes]]:
    """What a subscriber holds after ``events``: per medium, keys in the order they came."""
    held: dict[str, list[bytes]] = {}
    for e in events:
        if e.kind == CLEARED:
            held.clear()
        elif e.kind == STORED:
            held.setdefault(e.medium or "", []).extend(k for k in e.hashes if k not in held.get(e.medium or "", []))
        else:
            held[e.medium or ""] = [k for k in held.get(e.medium or "", []) if k not in e.hashes]
    return held


events_strategy = st.lists(st.one_of(
    st.builds(lambda m, ks, p: Event(STORED, m, [h(k) for k in ks], None if p is None else h(p)),
              st.sampled_from(["GPU", "CPU"]), st.lists(st.integers(0, 20), min_size=1, max_size=4),
              st.one_of(st.none(), st.integers(0, 20))),
    st.builds(lambda m, ks: Event(REMOVED, m, [h(k) for k in ks]), st.sampled_from(["GPU", "CPU"]),
              st.lists(st.integers(0, 20), min_size=1, max_size=4)),
    st.just(Event(CLEARED)),
), max_size=40)


@given(events_strategy)
def test_merging_runs_changes_nothing_a_subscriber_holds(events: list[Event]) -> None:
    merged = merge(events)
    assert fold(merged) == fold(events)
    assert sum(len(e.hashes) for e in merged) == sum(len(e.hashes) for e in events)
    assert len(merged) <= len(events)


def test_stores_merge_only_along_a_chain_and_removals_by_medium() -> None:
    log = EventLog()
    log.stored("GPU", [h(1)])
    log.stored("GPU", [h(2)], parent=h(1))  # continues the chain: one event
    log.stored("GPU", [h(9)], parent=h(5))  # another prompt's block: its own event
    log.removed("GPU", [h(1)])
    log.removed("GPU", [h(2)])
    log.removed("CPU", [h(3)])
    out = log.drain()
    assert [(e.kind, e.medium, e.hashes, e.parent) for e in out] == [
        (STORED, "GPU", [h(1), h(2)], None), (STORED, "GPU", [h(9)], h(5)),
        (REMOVED, "GPU", [h(1), h(2)], None), (REMOVED, "CPU", [h(3)], None)]
    assert log.drain() == [] and len(log) == 0
    assert log.counts[(STORED, "GPU")] == 3 and log.counts[(REMOVED, "CPU")] == 1


def test_an_overflow_resyncs_instead_of_blocking() -> None:
    log = EventLog(max_events=5)
    log.stored("GPU", [h(1), h(2), h(3)])
    log.removed("GPU", [h(1)])
    log.stored("CPU", [h(7), h(8)])  # 6 > 5: what waited is dropped, a clear goes first
    out = log.drain()
    assert [(e.kind, e.medium, e.hashes) for e in out] == [(CLEARED, None, []), (STORED, "CPU", [h(7), h(8)])]
    assert log.resyncs == 1 and log.dropped == 4
    assert fold(out) == {"CPU": [h(7), h(8)]}  # fewer blocks than the replica holds, never one it lost


def test_producers_on_many_threads_lose_nothing() -> None:
    log = EventLog()
    sinks = [MediumEvents(log, f"M{i}") for i in range(4)]

    def produce(sink: MediumEvents) -> None:
        for k in range(500):
            sink.stored(h(k))

    threads = [threading.Thread(target=produce, args=(s,)) for s in sinks]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    held = fold(log.drain())
    assert all(held[f"M{i}"] == [h(k) for k in range(500)] for i in range(4))


def test_the_pool_announces_what_it_caches_and_evicts() -> None:
    pool = BlockPool(4)
    log = EventLog()
    pool.events = MediumEvents(log, "GPU")
    a, b = pool.get_new_blocks(2)
    assert pool.cache_block(a, h(1)) and pool.cache_block(b, h(2), parent=h(1))
    assert pool.cache_block(b, h(2))  # the same block again: nothing new, nothing said
    pool.free_blocks([b, a])
    pool.get_new_blocks(4)  # takes every block: both cached prefixes are evicted
    out = log.drain()
    assert [(e.kind, e.hashes) for e in out] == [(STORED, [h(1), h(2)]), (REMOVED, [h(2), h(1)])]  # tail first
    assert pool.stats.cached == 2 and pool.stats.evictions == 2
