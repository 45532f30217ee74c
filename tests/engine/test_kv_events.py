"""KV events from the engine, read as a router reads them (pyzmq + msgpack): what the stream says
each medium holds is exactly what the pool and the tiers hold, every stored block is announced
once, every device and disk eviction is announced, a detached tier's blocks are withdrawn and a
restart starts with `AllBlocksCleared`, then the blocks its disk already holds."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from engine.core import EngineCore
from tests.engine.kv_event_stream import EventStream
from tests.engine.test_tiers_engine import flood, make_engine, prompt, run

pytestmark = pytest.mark.engine

ANY_PORT = "tcp://127.0.0.1:*"


def events_engine(model_dir: Path, disk: Path, **overrides) -> EngineCore:
    return make_engine(model_dir, disk_cache_path=str(disk), kv_events_endpoint=ANY_PORT,
                       kv_events_replay_endpoint=ANY_PORT, **overrides)


@contextmanager
def stream_of(core: EngineCore) -> Iterator[EventStream]:
    assert core.events is not None
    stream = EventStream(core.events.publisher.bound, core.events.publisher.replay_bound)
    try:
        yield stream
    finally:
        stream.close()


def settle(core: EngineCore, stream: EventStream) -> None:
    """Every write landed, every event sent and applied."""
    if core.chain is not None:
        assert core.chain.drain_writes(30)
    assert core.events is not None and core.events.publisher.wait_idle()
    stream.sync(core.events.publisher.seq)


def held(core: EngineCore) -> dict[str, set[bytes]]:
    """What the pool and each tier hold now, by the medium names of the events."""
    out = {"GPU": {h for h, _ in core.manager.pool.cached_blocks()}}
    chain = core.chain
    if chain is not None and chain.memory is not None:
        out["CPU"] = set(chain.memory.keys())
    if chain is not None and chain.store is not None:
        out["DISK"] = set(chain.store.keys())
    return out


def test_the_stream_matches_the_pool_and_tiers(tiny_model_dir: Path, tmp_path: Path) -> None:
    # 1 MiB tiers of 2 KiB blocks hold 480-512 blocks; 14 floods of 100 blocks overflow both
    core = events_engine(tiny_model_dir, tmp_path / "kv", disk_cache_mb=1, disk_persist="behind")
    try:
        with stream_of(core) as stream:
            prompts = [prompt(40 + i) for i in range(4)]
            for i, ids in enumerate(prompts):
                run(core, f"p{i}", ids)
            for seed in range(40, 47):
                flood(core, seed)  # device → host → disk, past both capacities
                assert core.chain.drain_writes(30)  # none dropped for want of a writer on a busy machine
            run(core, "again", prompts[0])  # back up from disk
            for seed in range(47, 80):
                flood(core, seed)
                assert core.chain.drain_writes(30)
                if seed >= 53 and core.stats()["tiers"]["disk"]["evictions"]:
                    break
            settle(core, stream)
            assert stream.problems == []
            assert stream.clears == 1  # the start
            truth = held(core)
            for medium, keys in truth.items():
                assert stream.held.get(medium, set()) == keys, medium
            pool = core.manager.pool.stats
            assert stream.counts[("BlockStored", "GPU")] == pool.cached > 0
            assert stream.counts[("BlockRemoved", "GPU")] == pool.evictions > 0
            disk = core.stats()["tiers"]["disk"]
            assert disk["evictions"] > 0  # the last tier evicted, and said so
            assert stream.counts[("BlockRemoved", "DISK")] >= disk["evictions"]
            assert stream.block_size == 4
            snap = core.stats()["events"]
            assert snap["batches"] == core.events.publisher.seq and snap["resyncs"] == 0
            assert snap["blocks"]["BlockStored"]["GPU"] == pool.cached

            core.configure_tier("detach", "host")
            settle(core, stream)
            assert stream.held.get("CPU") == set() and stream.problems == []
            core.configure_tier("attach", "host")
            run(core, "after-attach", prompts[1])
            flood(core, 42)
            settle(core, stream)
            assert stream.problems == []
            for medium, keys in held(core).items():
                assert stream.held.get(medium, set()) == keys, medium
    finally:
        core.close()


def test_a_restart_clears_then_announces_what_disk_holds(tiny_model_dir: Path, tmp_path: Path) -> None:
    first = events_engine(tiny_model_dir, tmp_path / "kv")
    try:
        run(first, "a", prompt(50))
    finally:
        first.close()  # flushes device and host blocks to disk
    second = events_engine(tiny_model_dir, tmp_path / "kv")
    try:
        with stream_of(second) as stream:
            settle(second, stream)
            on_disk = set(second.chain.store.keys())
            assert len(on_disk) >= 30
            assert stream.clears == 1 and stream.held.get("DISK") == on_disk and stream.problems == []
    finally:
        second.close()


def test_no_endpoint_no_events(tiny_model_dir: Path) -> None:
    core = make_engine(tiny_model_dir)
    try:
        assert core.events is None and core.stats()["events"] is None
        run(core, "a", prompt(60))
    finally:
        core.close()


def test_an_endpoint_in_use_fails_the_start_with_the_reason(tiny_model_dir: Path, tmp_path: Path) -> None:
    first = events_engine(tiny_model_dir, tmp_path / "kv1")
    try:
        taken = first.events.publisher.bound
        with pytest.raises(OSError, match="cannot bind .*events"):
            make_engine(tiny_model_dir, kv_events_endpoint=taken)
    finally:
        first.close()
