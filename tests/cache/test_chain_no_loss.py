"""No block in no tier: a block leaving host memory stays readable (from host, or from its disk
write's buffer) until its disk record is complete and indexed; when disk writes back up, host
eviction passes over blocks not yet on disk; ``persist = "behind"`` keeps host blocks written."""

from __future__ import annotations

import asyncio
import random
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from cache.tiers.chain import TierChain
from cache.tiers.disk import DiskTier
from cache.tiers.host import HostTier
from tests.cache.test_tier_chain import FMT, NB, WAIT_S, block, key, load, poll_until, raw


class SlowDisk(DiskTier):
    """A disk tier whose writes take a random while (or wait for a gate): the window in which a
    block has left host memory and is not yet indexed on disk stays open long enough to hit."""

    def __init__(self, *args: Any, max_delay_s: float = 0.0, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.max_delay_s = max_delay_s
        self.gate = threading.Event()
        self.gate.set()
        self.rng = random.Random(7)

    async def write(self, *args: Any, **kwargs: Any) -> bool:
        while not self.gate.is_set():
            await asyncio.sleep(0.001)
        if self.max_delay_s:
            await asyncio.sleep(self.rng.uniform(0, self.max_delay_s))
        return await super().write(*args, **kwargs)


@pytest.fixture
def made(tmp_path: Path) -> Iterator[list[TierChain]]:
    chains: list[TierChain] = []
    try:
        yield chains
    finally:
        for chain in chains:
            if chain.store is not None:
                chain.store.gate.set()  # type: ignore[attr-defined]
            chain.close()


def slow_chain(tmp_path: Path, host_blocks: int = 2, max_pending_writes: int = 256, persist: str = "on_evict",
               max_delay_s: float = 0.0, behind_delay_s: float = 0.0) -> TierChain:
    disk = SlowDisk(tmp_path / "disk", 256 * FMT.record_size, FMT, max_delay_s=max_delay_s)
    return TierChain([HostTier(host_blocks * NB, NB), disk], max_pending_writes=max_pending_writes, persist=persist,
                     behind_delay_s=behind_delay_s)


def test_a_block_being_written_is_found_recalled_and_loaded(tmp_path: Path, made: list[TierChain]) -> None:
    made.append(chain := slow_chain(tmp_path))
    assert chain.memory is not None and chain.store is not None
    chain.store.gate.clear()  # type: ignore[attr-defined]
    for i in range(4):  # host of 2: blocks 0 and 1 leave for disk, whose writes wait
        chain.demote(key(i), block(i))
    assert chain.pending_writes == 2 and key(0) not in chain.store and key(0) not in chain.memory
    # a lookup during the write finds it, and it is not planned as a disk read
    assert chain.on_lower_tier(key(0)) and chain.local_end([key(0), key(1), key(9)]) == 2
    assert chain.plan_prefetch([key(0), key(1)], 16, None) == []
    out = load(chain, 1)  # promotion straight from the write's buffer
    assert out is not None and torch.equal(out, block(1))
    # a request that wants block 0 takes it back into host, where it stays whatever the write does
    assert chain.recall([key(0), key(9)]) == 1
    assert key(0) in chain.memory and chain.stats.recalled_blocks == 2
    chain.store.gate.set()  # type: ignore[attr-defined]
    assert chain.drain_writes(WAIT_S)
    assert not chain._writing
    assert key(0) in chain.store and key(1) in chain.store
    assert chain.stats.dropped_writes == 0
    chain.memory.check_invariants()
    chain.store.check_invariants()


def test_backed_up_writes_evict_a_block_already_on_disk_instead_of_dropping(tmp_path: Path,
                                                                            made: list[TierChain]) -> None:
    made.append(chain := slow_chain(tmp_path, host_blocks=4, max_pending_writes=1))
    assert chain.memory is not None and chain.store is not None
    demote_and_persist = [10, 11]  # on disk already, then back in host (as after a disk read)
    for i in demote_and_persist:
        chain.demote(key(i), block(i))
    assert chain.flush([], WAIT_S) == 2 and all(key(i) in chain.store for i in demote_and_persist)
    chain.store.gate.clear()  # type: ignore[attr-defined]
    for i in range(3):  # fills host (4), then one eviction: 10, the oldest, is on disk: no write
        chain.demote(key(i), block(i))
    assert chain.pending_writes == 0 and key(10) not in chain.memory
    chain.demote(key(3), block(3))  # evicts 11 (on disk): still no write
    chain.demote(key(4), block(4))  # evicts 0: one write in flight, the bound
    assert chain.pending_writes == 1 and key(0) in chain._writing
    chain.demote(key(5), block(5))  # backed up: 1, the oldest, is not on disk; none is: dropped
    assert chain.stats.dropped_writes == 1
    chain.store.gate.set()  # type: ignore[attr-defined]
    assert chain.drain_writes(WAIT_S)
    # with a block on disk in host again, a backed-up eviction takes it and spares the others
    assert chain.recall([key(0)]) == 0  # on disk, not being written: nothing to recall
    assert chain.prefetch("r", chain.plan_prefetch([key(0)], 16, None))
    poll_until(chain, ["r"])  # 0 is in host again, and on disk; it evicted 2 (written)
    assert chain.drain_writes(WAIT_S)
    kept_before = chain.memory.kept
    chain.store.gate.clear()  # type: ignore[attr-defined]
    chain.demote(key(6), block(6))  # evicts the LRU, 3 (not on disk): a write, now in flight
    assert chain.pending_writes == 1
    chain.demote(key(7), block(7))  # backed up: 4 is LRU and not on disk, 0 is on disk: 0 leaves
    assert chain.stats.dropped_writes == 1 and chain.memory.kept == kept_before + 1
    assert key(4) in chain.memory and key(0) not in chain.memory and key(0) in chain.store
    chain.store.gate.set()  # type: ignore[attr-defined]
    assert chain.drain_writes(WAIT_S)
    chain.memory.check_invariants()


def test_persist_behind_writes_host_blocks_oldest_first(tmp_path: Path, made: list[TierChain]) -> None:
    made.append(chain := slow_chain(tmp_path, host_blocks=8, max_pending_writes=4, persist="behind"))
    assert chain.memory is not None and chain.store is not None
    for i in range(6):
        chain.demote(key(i), block(i))
    assert len(chain.store) == 0  # nothing leaves host: on_evict would write nothing yet
    assert chain.persist_behind() == 2  # half the write bound at a time, oldest first
    assert chain.drain_writes(WAIT_S)
    assert {k for k in (key(i) for i in range(6)) if k in chain.store} == {key(0), key(1)}
    deadline = time.monotonic() + WAIT_S
    while len(chain.store) < 6:
        assert time.monotonic() < deadline
        chain.persist_behind()
        time.sleep(0.005)
    assert chain.drain_writes(WAIT_S) and chain.stats.persisted_behind == 6
    for i in range(6):  # every record is whole, and evicting the blocks later costs no write
        assert bytes(asyncio.run_coroutine_threadsafe(chain.store.read(key(i)), chain.io.loop).result(WAIT_S)) == raw(i)
    writes = chain.store.stats.writes
    for i in range(6, 14):
        chain.demote(key(i), block(i))
    assert chain.pending_writes == 0 and chain.store.stats.writes == writes


def test_persist_behind_waits_while_busy_up_to_its_delay(tmp_path: Path, made: list[TierChain]) -> None:
    """``behind_delay_s``: while steps run back to back (``busy``) a block's background write waits
    until the block was noted that long ago, oldest first; a call while idle writes at once."""
    made.append(chain := slow_chain(tmp_path, host_blocks=8, persist="behind", behind_delay_s=10.0))
    assert chain.memory is not None and chain.store is not None
    now = [100.0]
    chain._clock = lambda: now[0]
    for i in range(3):
        chain.demote(key(i), block(i))
    now[0] = 105.0
    for i in range(3, 5):
        chain.demote(key(i), block(i))
    assert chain.persist_behind(busy=True) == 0 and chain.snapshot()["chain"]["unpersisted_blocks"] == 5
    now[0] = 110.0  # blocks 0-2 are 10 s old, 3 and 4 five
    assert chain.persist_behind(busy=True) == 3 and chain.drain_writes(WAIT_S)
    assert {i for i in range(5) if key(i) in chain.store} == {0, 1, 2}
    assert chain.persist_behind(busy=False) == 2 and chain.drain_writes(WAIT_S)  # idle: the rest at once
    assert all(key(i) in chain.store for i in range(5)) and chain.stats.persisted_behind == 5
    assert chain.snapshot()["chain"]["behind_delay_s"] == 10.0 and not chain._unpersisted


def test_a_zero_delay_or_another_mode_writes_behind_while_busy(tmp_path: Path, made: list[TierChain]) -> None:
    made.append(chain := slow_chain(tmp_path, host_blocks=8, persist="behind"))
    for i in range(3):
        chain.demote(key(i), block(i))
    assert chain.persist_behind(busy=True) == 3 and chain.drain_writes(WAIT_S)
    with pytest.raises(ValueError, match="behind_delay_s"):
        TierChain(persist="behind", behind_delay_s=-1.0)


def test_a_torn_copy_keeps_its_place_in_time(tmp_path: Path, made: list[TierChain]) -> None:
    """A device block whose copy was found torn goes back to the front of the line with the time
    it was first noted, so a retry does not restart its delay nor wait behind younger blocks."""
    from cache.tiers.writes import RETRY

    made.append(chain := slow_chain(tmp_path, host_blocks=8, persist="behind", behind_delay_s=10.0))
    now = [100.0]
    chain._clock = lambda: now[0]
    copies = [RETRY, raw(7)]
    chain.note_computed(key(7), lambda: copies.pop(0))
    now[0] = 111.0
    assert chain.persist_behind(busy=True) == 1 and chain.drain_writes(WAIT_S)
    assert key(7) not in chain.store  # the first copy was torn: not written
    chain.note_computed(key(8), lambda: raw(8))  # noted now: younger than the delay
    deadline = time.monotonic() + WAIT_S
    while key(7) not in chain.store:  # the retry is 11 s old already: written while busy
        assert time.monotonic() < deadline, "the torn copy was never retried"
        chain.persist_behind(busy=True)
        chain.drain_writes(WAIT_S)
        time.sleep(0.005)
    assert key(8) not in chain.store and list(chain._unpersisted) == [key(8)]


def test_persist_idle_writes_behind_on_the_idle_thread_only(tmp_path: Path, made: list[TierChain],
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """``persist = "idle"`` writes host blocks behind as ``"behind"`` does, but every copy and
    write runs on the I/O loop's idle writer (scheduled only on idle CPU); demotions (blocks
    leaving host memory, which must be written) stay on the normal writers."""
    import os

    from cache.tiers import ioloop

    # the idle writer's scheduling class is test_tier_chain's; here it must run on a busy machine too
    monkeypatch.setattr(ioloop, "_idle_only", lambda: None)
    made.append(chain := slow_chain(tmp_path, host_blocks=8, persist="idle"))
    assert chain.memory is not None and chain.store is not None and chain.io is not None and chain.writes_behind
    threads: list[str] = []
    real_writev = os.writev

    def spy_writev(fd: int, bufs: Any) -> int:
        threads.append(threading.current_thread().name)
        return real_writev(fd, bufs)

    monkeypatch.setattr(os, "writev", spy_writev)
    for i in range(6):
        chain.demote(key(i), block(i))
    deadline = time.monotonic() + WAIT_S
    while len(chain.store) < 6:
        assert time.monotonic() < deadline, "the idle writer never wrote the host blocks"
        chain.persist_behind()
        time.sleep(0.005)
    assert chain.drain_writes(WAIT_S) and chain.stats.persisted_behind == 6
    assert len(threads) == 6 and all(name.startswith("kvgate-io-idle") for name in threads), threads
    for i in range(6):
        got = asyncio.run_coroutine_threadsafe(chain.store.read(key(i)), chain.io.loop).result(WAIT_S)
        assert bytes(got) == raw(i)
    threads.clear()
    for i in range(6, 16):  # evictions: 0-5 are on disk already (no write), 6 and 7 are not
        chain.demote(key(i), block(i))
    assert chain.drain_writes(WAIT_S)
    assert threads and all(name.startswith("kvgate-io-write") for name in threads), threads


def test_a_block_moved_during_its_background_copy_is_not_written_torn(tmp_path: Path, made: list[TierChain]) -> None:
    made.append(chain := slow_chain(tmp_path, host_blocks=2, persist="behind"))
    host = chain.memory
    assert host is not None
    chain.demote(key(0), block(0))
    slot = host.slot_of(key(0))
    assert slot is not None and host.snapshot(key(0), slot) == raw(0)
    host.delete(key(0))
    chain.demote(key(1), block(1))  # (may reuse the slot)
    assert host.snapshot(key(0), slot) is None


class NoLossMachine(RuleBasedStateMachine):
    """Demotions, lookups and loads while disk writes finish at random moments on the I/O thread:
    every block demoted is always found in some tier and loads with its own bytes (the disk is
    big enough that its policy evicts nothing, and the write bound is never reached)."""

    @initialize(persist=st.sampled_from(["on_evict", "behind", "idle"]), host_blocks=st.integers(1, 4))
    def setup(self, persist: str, host_blocks: int) -> None:
        self.folder = tempfile.TemporaryDirectory()
        self.chain = slow_chain(Path(self.folder.name), host_blocks=host_blocks, persist=persist, max_delay_s=0.003)
        self.demoted: list[int] = []
        self.next = 0

    def teardown(self) -> None:
        chain = getattr(self, "chain", None)
        if chain is not None:
            chain.drain_writes(WAIT_S)
            chain.close()
            self.folder.cleanup()

    @rule()
    def demote(self) -> None:
        i, self.next = self.next, self.next + 1
        self.chain.demote(key(i), block(i))
        self.demoted.append(i)

    @rule(data=st.data())
    def recall_and_load(self, data: st.DataObject) -> None:
        if not self.demoted:
            return
        i = data.draw(st.sampled_from(self.demoted))
        self.chain.recall([key(i)])
        out = load(self.chain, i)
        if out is not None:
            assert torch.equal(out, block(i))
        else:  # only on disk: its record is whole
            disk = self.chain.store
            assert disk is not None and key(i) in disk
            assert self.chain.io is not None
            got = asyncio.run_coroutine_threadsafe(disk.read(key(i)), self.chain.io.loop).result(WAIT_S)
            assert got is not None and bytes(got) == raw(i)

    @rule()
    def background(self) -> None:
        self.chain.persist_behind()

    @rule()
    def pause(self) -> None:
        time.sleep(0.002)  # let writes end meanwhile

    @invariant()
    def every_block_is_somewhere(self) -> None:
        chain = self.chain
        for i in self.demoted:
            assert chain.on_lower_tier(key(i)) or key(i) in chain.store, f"block {i} is in no tier"
        assert chain.stats.dropped_writes == 0


NoLossMachine.TestCase.settings = settings(max_examples=25, stateful_step_count=40, deadline=None,
                                           suppress_health_check=[HealthCheck.too_slow])
test_no_block_in_no_tier = NoLossMachine.TestCase
