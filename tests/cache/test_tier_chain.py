"""TierChain: demotion through host to disk, promotion from host, disk prefetch released by poll,
load-or-recompute, write back-pressure and the shutdown flush."""

from __future__ import annotations

import asyncio
import gc
import threading
import time
from collections.abc import Callable, Hashable, Iterable, Iterator
from pathlib import Path

import pytest
import torch

from cache.tiers.chain import TierChain
from cache.tiers.codec import BlockFormat
from cache.tiers.disk import DiskTier
from cache.tiers.host import HostTier
from cache.tiers.remote import RemoteTier

MAC_KEY = bytes(range(100, 132))  # the store key every replica of a test deployment shares

FMT = BlockFormat(bytes(range(32)), "float16", (4, 8))  # 64-byte blocks
NB = FMT.payload_size
WAIT_S = 10.0  # upper bound of every polling loop; never reached when things work


def key(i: int) -> bytes:
    return i.to_bytes(32, "big")


def block(i: int) -> torch.Tensor:
    return torch.tensor([(i * 29 + j * 3) % 256 for j in range(NB)], dtype=torch.uint8)


def raw(i: int) -> bytes:
    return block(i).numpy().tobytes()


def make_chain(tmp_path: Path, host_blocks: int | None = 2, disk_blocks: int = 32,
               max_pending_writes: int = 256) -> TierChain:
    host = HostTier(host_blocks * NB, NB) if host_blocks else None
    disk = DiskTier(tmp_path / "disk", disk_blocks * FMT.record_size, FMT)
    return TierChain([host, disk], max_pending_writes=max_pending_writes)


@pytest.fixture
def chains(tmp_path: Path) -> Iterator[list[TierChain]]:
    """Chains a test creates are closed whatever happens."""
    made: list[TierChain] = []
    try:
        yield made
    finally:
        for chain in made:
            chain.close()


@pytest.fixture
def chain(tmp_path: Path, chains: list[TierChain]) -> TierChain:
    chains.append(make_chain(tmp_path))
    return chains[-1]


def load(chain: TierChain, i: int) -> torch.Tensor | None:
    dst = torch.zeros(NB, dtype=torch.uint8)
    return dst if chain.load(key(i), dst) else None


def poll_until(chain: TierChain, tokens: Iterable[Hashable]) -> list[Hashable]:
    """Poll until every token in ``tokens`` was released; returns all released, in order."""
    want = set(tokens)
    released: list[Hashable] = []
    deadline = time.monotonic() + WAIT_S
    while not want <= set(released):
        assert time.monotonic() < deadline, f"tokens {want - set(released)} never released"
        released += chain.poll()
        time.sleep(0.002)
    return released


def demote_all(chain: TierChain, ids: Iterable[int]) -> None:
    for i in ids:
        chain.demote(key(i), block(i))
    assert chain.drain_writes(WAIT_S)


# ---- demotion ---------------------------------------------------------------------------------


def test_overflow_reaches_disk(chain: TierChain) -> None:
    assert chain.memory is not None and chain.store is not None
    demote_all(chain, range(5))
    assert chain.stats.demotions == 5
    assert set(chain.memory.keys()) == {key(3), key(4)}  # LRU: the newest two stay in host
    for i in range(3):
        assert key(i) in chain.store
        assert chain.store.path_of(key(i)).exists()
    assert len(chain.store) == 3 and chain.pending_writes == 0
    assert chain.memory.stats.evictions == 3
    chain.store.check_invariants()
    chain.memory.check_invariants()


def test_load_from_host(chain: TierChain) -> None:
    demote_all(chain, range(3))
    out = load(chain, 2)
    assert out is not None and torch.equal(out, block(2))
    assert chain.stats.promotions == 1
    assert load(chain, 0) is None  # on disk only: never read synchronously
    assert load(chain, 99) is None
    assert chain.stats.promotions == 1
    assert chain.on_lower_tier(key(2)) and not chain.on_lower_tier(key(0))


def test_disk_only_chain_demotes_straight_to_disk(tmp_path: Path, chains: list[TierChain]) -> None:
    chains.append(chain := make_chain(tmp_path, host_blocks=None))
    assert chain.memory is None and chain.store is not None
    demote_all(chain, range(3))
    assert len(chain.store) == 3
    assert chain.plan_prefetch([key(0), key(1)], 16, None) == [key(0), key(1)]
    assert chain.prefetch("r", [key(0), key(1)])
    poll_until(chain, ["r"])
    # staged until promoted, then handed out once
    out = load(chain, 1)
    assert out is not None and torch.equal(out, block(1))
    assert load(chain, 1) is None


def test_chain_without_disk(chains: list[TierChain]) -> None:
    chains.append(chain := TierChain([HostTier(2 * NB, NB)]))
    assert chain.io is None
    for i in range(4):
        chain.demote(key(i), block(i))  # the overflow is simply dropped
    assert chain.plan_prefetch([key(0)], 16, None) == []
    assert chain.flush([], timeout_s=1) == 0
    assert load(chain, 3) is not None


# ---- prefetch planning ------------------------------------------------------------------------


def test_plan_prefetch_continuation(chain: TierChain) -> None:
    demote_all(chain, range(5))  # 0, 1, 2 on disk; 3, 4 in host
    keys = [key(3), key(0), key(1), key(50), key(2)]
    assert chain.plan_prefetch(keys, 16, None) == [key(0), key(1)]  # stops at 50: nowhere
    assert chain.plan_prefetch([key(4), key(3)], 16, None) == []  # all in host
    assert chain.plan_prefetch([key(50), key(0)], 16, None) == []
    assert chain.stats.recompute_chosen == 0


def test_plan_prefetch_chooses_recompute_when_prefill_is_faster(chain: TierChain) -> None:
    demote_all(chain, range(5))
    keys = [key(0), key(1), key(2)]
    assert chain.plan_prefetch(keys, 16, prefill_tokens_per_s=1e15) == []
    assert chain.stats.recompute_chosen == 1
    # a slow prefill makes loading the better choice
    assert chain.plan_prefetch(keys, 16, prefill_tokens_per_s=1e-3) == keys
    assert chain.stats.recompute_chosen == 1
    # nothing on disk: nothing to decide
    assert chain.plan_prefetch([key(77)], 16, prefill_tokens_per_s=1e15) == []
    assert chain.stats.recompute_chosen == 1


# ---- prefetch and poll ------------------------------------------------------------------------


def test_prefetch_then_poll_releases_and_blocks_are_in_host(tmp_path: Path, chains: list[TierChain]) -> None:
    chains.append(chain := make_chain(tmp_path, host_blocks=4))
    demote_all(chain, range(8))  # 0..3 on disk, 4..7 in host
    assert chain.store is not None and chain.memory is not None
    need = chain.plan_prefetch([key(0), key(1), key(2)], 16, None)
    assert need == [key(0), key(1), key(2)]
    assert chain.prefetch("req-1", need)
    assert chain.loading
    assert chain.plan_prefetch([key(0), key(1), key(2)], 16, None) == []  # in flight
    released = poll_until(chain, ["req-1"])
    assert released == ["req-1"]
    assert not chain.loading and chain.poll() == []
    assert chain.stats.prefetches == 1 and chain.stats.prefetched_blocks == 3
    assert chain.store.stats.reads == 3
    for i in range(3):
        assert key(i) in chain.memory
        out = load(chain, i)
        assert out is not None and torch.equal(out, block(i))
    assert chain.drain_writes(WAIT_S)  # host evictions caused by the loads went down
    chain.memory.check_invariants()
    chain.store.check_invariants()


def test_disk_reads_land_in_reserved_host_slots(tmp_path: Path, chains: list[TierChain]) -> None:
    """A prefetch reserves one host slot per block and the file is read straight into it: the
    block appears in host memory without a copy by the loop; a failed read gives its slot back."""
    chains.append(chain := make_chain(tmp_path, host_blocks=8, disk_blocks=64))
    assert chain.store is not None and chain.memory is not None
    for i in range(40):
        asyncio.run(chain.store.write(key(i), raw(i)))
    chain.store.path_of(key(3)).write_bytes(b"\0" * FMT.record_size)  # corrupt on disk
    keys = [key(i) for i in range(6)]
    assert chain.plan_prefetch(keys, 16, None) == keys
    assert chain.prefetch("r", keys)
    assert len(chain.memory._reserved) == 6 and len(chain.memory) == 0  # slots held, nothing indexed yet
    poll_until(chain, ["r"])
    assert not chain.memory._reserved
    assert [key(i) in chain.memory for i in range(6)] == [True, True, True, False, True, True]
    assert chain.store.stats.corrupt == 1 and chain.stats.prefetched_blocks == 5
    for i in (0, 1, 2, 4, 5):
        out = load(chain, i)
        assert out is not None and torch.equal(out, block(i))
    chain.memory.check_invariants()
    chain.store.check_invariants()
    # a load bigger than the host: every slot is reserved, the rest arrive in buffers of their own
    more = [key(i) for i in range(10, 40)]
    assert chain.prefetch("big", chain.plan_prefetch(more, 16, None))
    poll_until(chain, ["big"])
    assert chain.stats.prefetched_blocks == 5 + 30
    assert len(chain.memory) == 8 and not chain.memory._reserved
    chain.memory.check_invariants()


def test_room_for_a_load_is_not_taken_from_the_same_requests_host_blocks(tmp_path: Path,
                                                                        chains: list[TierChain]) -> None:
    """A prompt whose first blocks are in host (least recently used) and the rest on disk: the
    slots for the disk blocks are made by evicting other blocks, not the prompt's own."""
    chains.append(chain := make_chain(tmp_path, host_blocks=4))
    assert chain.store is not None and chain.memory is not None
    for i in (2, 3):
        asyncio.run(chain.store.write(key(i), raw(i)))
    for i in (0, 1, 50, 51):  # the prompt's blocks 0 and 1 first: the LRU ones
        chain.memory.put(key(i), block(i))
    prompt = [key(i) for i in range(4)]
    need = chain.plan_prefetch(prompt, 16, None)
    assert need == [key(2), key(3)]
    assert chain.prefetch("r", need, also_wait_for=prompt)
    poll_until(chain, ["r"])
    assert all(k in chain.memory for k in prompt)
    assert key(50) not in chain.memory and key(51) not in chain.memory
    chain.memory.check_invariants()


def test_many_blocks_are_read_in_parallel_batches(tmp_path: Path, chains: list[TierChain]) -> None:
    chains.append(chain := make_chain(tmp_path, host_blocks=128, disk_blocks=128))
    assert chain.store is not None and chain.memory is not None
    for i in range(100):
        asyncio.run(chain.store.write(key(i), raw(i)))
    keys = [key(i) for i in range(100)]
    assert chain.prefetch("r", chain.plan_prefetch(keys, 16, None))
    poll_until(chain, ["r"])
    ops = chain.ops["disk_read"].snapshot()["ops"]
    assert 2 <= ops < 100  # batches, not one call per block, and more than one
    assert chain.store.stats.hits == 100 and len(chain.memory) == 100
    for i in range(100):
        out = load(chain, i)
        assert out is not None and torch.equal(out, block(i))


def test_a_remote_block_wanted_by_two_requests_is_fetched_once(redis_url: str, chains: list[TierChain]) -> None:
    """Two requests arriving together for the same prefix in Redis: one GET pipeline (the
    second waits for the first's), both released with every block in host memory."""
    remote = RemoteTier(redis_url, FMT, ttl_s=120, timeout_s=5.0, mac_key=MAC_KEY)
    chains.append(chain := TierChain([HostTier(32 * NB, NB), remote]))
    assert chain.io is not None
    assert chain.io.submit(remote.put([(key(i), raw(i)) for i in range(12)])).result(WAIT_S)
    keys = [key(i) for i in range(12)]
    calls: list[int] = []
    real_get = remote.get

    async def slow_get(wanted: list[bytes], dests=()) -> list[memoryview | None]:
        calls.append(len(wanted))
        await asyncio.sleep(1.0)  # b's existence check certainly ends while a's GET is in flight
        return await real_get(wanted, dests)

    remote.get = slow_get  # type: ignore[method-assign]
    assert chain.prefetch("a", [], remote_keys=keys)
    assert chain.prefetch("b", [], remote_keys=keys)
    released = poll_until(chain, ["a", "b"])
    assert sorted(map(str, released)) == ["a", "b"]
    assert calls == [12] and remote.stats.reads == 1 and remote.stats.hits == 12
    assert chain.memory is not None and all(k in chain.memory for k in keys)
    # each job reserved its own 12 slots; b's, never written (it waited for a's GET), are free again
    chain.memory.check_invariants()
    assert not chain.memory._reserved and len(chain.memory._free) == 32 - 12
    for i in range(12):
        out = load(chain, i)
        assert out is not None and torch.equal(out, block(i))


def _recording_gets(remote: RemoteTier) -> list[list[memoryview | None]]:
    """Make ``remote.get`` record the destinations it is given (then do the real GET)."""
    seen: list[list[memoryview | None]] = []
    real_get = remote.get

    async def get(wanted: list[bytes], dests=()) -> list[memoryview | None]:
        seen.append(list(dests))
        return await real_get(wanted, dests)

    remote.get = get  # type: ignore[method-assign]
    return seen


def _in_slab(host: HostTier, view: memoryview) -> bool:
    import numpy

    start = host.slots.data_ptr()
    address = numpy.frombuffer(view, dtype=numpy.uint8).ctypes.data
    return start <= address < start + host.slots.numel()


def test_remote_blocks_land_straight_in_free_host_slots(redis_url: str, chains: list[TierChain]) -> None:
    """With free host slots, a remote load's payloads are received into them (no copy after);
    the slots of blocks the store lacks are freed again."""
    remote = RemoteTier(redis_url, FMT, ttl_s=120, timeout_s=5.0, mac_key=MAC_KEY)
    chains.append(chain := TierChain([HostTier(16 * NB, NB), remote]))
    host = chain.memory
    assert chain.io is not None and host is not None
    assert chain.io.submit(remote.put([(key(i), raw(i)) for i in range(6)])).result(WAIT_S)
    seen = _recording_gets(remote)
    assert chain.prefetch("r", [], remote_keys=[key(i) for i in range(9)])  # 6 stored, 3 not
    assert poll_until(chain, ["r"]) == ["r"]
    assert len(seen) == 1 and len(seen[0]) == 6 and all(d is not None and _in_slab(host, d) for d in seen[0])
    host.check_invariants()
    assert len(host) == 6 and not host._reserved and len(host._free) == 10  # the 3 misses' slots are free again
    for i in range(6):
        out = load(chain, i)
        assert out is not None and torch.equal(out, block(i))


def test_a_remote_key_asked_for_twice_holds_one_slot(redis_url: str, chains: list[TierChain]) -> None:
    remote = RemoteTier(redis_url, FMT, ttl_s=120, timeout_s=5.0, mac_key=MAC_KEY)
    chains.append(chain := TierChain([HostTier(8 * NB, NB), remote]))
    host = chain.memory
    assert chain.io is not None and host is not None
    assert chain.io.submit(remote.put([(key(70), raw(70))])).result(WAIT_S)
    assert chain.prefetch("r", [], remote_keys=[key(70), key(70), key(71), key(71)])
    poll_until(chain, ["r"])
    host.check_invariants()
    assert key(70) in host and not host._reserved and len(host._free) == 7


def test_a_full_host_evicts_nothing_for_remote_blocks_the_store_lacks(redis_url: str,
                                                                       chains: list[TierChain]) -> None:
    """Remote loads take only free slots: with the host full, a lookup that misses costs no host
    block, and a hit still arrives (in buffers of its own, copied in, evicting as a put does)."""
    remote = RemoteTier(redis_url, FMT, ttl_s=120, timeout_s=5.0, mac_key=MAC_KEY)
    chains.append(chain := TierChain([HostTier(4 * NB, NB), remote]))
    host = chain.memory
    assert chain.io is not None and host is not None
    for i in range(4):
        chain.demote(key(i), block(i))
    seen = _recording_gets(remote)
    assert chain.prefetch("miss", [], remote_keys=[key(50), key(51)])
    poll_until(chain, ["miss"])
    assert seen == [] and sorted(host.keys()) == [key(i) for i in range(4)] and host.stats.evictions == 0
    assert chain.io.submit(remote.put([(key(60), raw(60))])).result(WAIT_S)
    assert chain.prefetch("hit", [], remote_keys=[key(60)])
    poll_until(chain, ["hit"])
    assert seen == [[None]] and key(60) in host and host.stats.evictions == 1
    host.check_invariants()
    out = load(chain, 60)
    assert out is not None and torch.equal(out, block(60))


def test_prefetch_with_nothing_to_wait_for(chain: TierChain) -> None:
    assert not chain.prefetch("r", [], also_wait_for=[key(1)])
    assert not chain.loading and chain.poll() == []


def test_block_wanted_by_two_requests_is_read_once(tmp_path: Path, chains: list[TierChain]) -> None:
    chains.append(chain := make_chain(tmp_path, host_blocks=4))
    demote_all(chain, range(8))
    assert chain.store is not None
    keys = [key(0), key(1)]
    assert chain.prefetch("a", chain.plan_prefetch(keys, 16, None))
    need_b = chain.plan_prefetch(keys, 16, None)
    assert need_b == []  # both already being read for "a"
    assert chain.prefetch("b", need_b, also_wait_for=keys)  # waits on a's reads
    released = poll_until(chain, ["a", "b"])
    assert sorted(map(str, released)) == ["a", "b"]
    assert chain.store.stats.reads == 2 and chain.store.stats.hits == 2
    assert chain.stats.prefetched_blocks == 2


def test_failed_read_still_releases_the_waiter(chain: TierChain) -> None:
    demote_all(chain, range(5))
    assert chain.store is not None
    chain.store.path_of(key(0)).write_bytes(b"\0" * FMT.record_size)  # corrupt on disk
    assert chain.prefetch("r", [key(0), key(1)])
    poll_until(chain, ["r"])
    assert chain.store.stats.corrupt == 1
    assert load(chain, 0) is None  # the damaged block never reaches a device block
    out = load(chain, 1)
    assert out is not None and torch.equal(out, block(1))


def test_cancel(chain: TierChain) -> None:
    demote_all(chain, range(5))
    assert chain.prefetch("gone", [key(0)])
    assert chain.prefetch("kept", [key(1)])
    chain.cancel("gone")
    released = poll_until(chain, ["kept"])
    assert "gone" not in released
    assert not chain.loading


# ---- back-pressure ----------------------------------------------------------------------------


def test_pending_write_limit_drops_and_counts(tmp_path: Path, chains: list[TierChain]) -> None:
    chains.append(chain := make_chain(tmp_path, host_blocks=2, max_pending_writes=1))
    assert chain.io is not None and chain.store is not None
    gate = threading.Event()

    async def stall() -> None:
        gate.wait(WAIT_S)  # blocks the I/O loop: no write can finish until the gate opens

    try:
        chain.io.submit(stall())
        for i in range(5):  # host of 2: three evictions, one may be in flight
            chain.demote(key(i), block(i))
        assert chain.pending_writes == 1
        assert chain.stats.dropped_writes == 2
    finally:
        gate.set()
    assert chain.drain_writes(WAIT_S)
    assert chain.pending_writes == 0
    assert len(chain.store) == 1 and key(0) in chain.store
    chain.demote(key(5), block(5))  # evicts 3 from host; room again once the write finished
    assert chain.drain_writes(WAIT_S)
    assert key(3) in chain.store and chain.stats.dropped_writes == 2


def test_close_with_writes_in_flight_unwinds_them(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    chain = make_chain(tmp_path, host_blocks=1)
    io = chain.io
    assert io is not None
    gate = threading.Event()

    async def stall() -> None:
        gate.wait(WAIT_S)

    try:
        io.submit(stall())
        for i in range(6):  # five writes queue up behind the stalled loop
            chain.demote(key(i), block(i))
        assert chain.pending_writes == 5
    finally:
        gate.set()
    chain.close()  # at once: the writes are still queued or in flight
    gc.collect()
    assert chain.io is None and not io.thread.is_alive() and io.loop.is_closed()
    assert chain.pending_writes == 0  # each write finished or was cancelled on its own loop
    assert "Task was destroyed" not in caplog.text
    again = DiskTier(tmp_path / "disk", 32 * FMT.record_size, FMT)  # a cut-off write leaves nothing
    assert not list(again.dir.glob("*.tmp"))
    again.check_invariants()


# ---- flush ------------------------------------------------------------------------------------


def test_flush_writes_host_and_given_blocks(tmp_path: Path, chains: list[TierChain]) -> None:
    chains.append(chain := make_chain(tmp_path, host_blocks=3))
    demote_all(chain, range(4))  # 0 on disk; 1, 2, 3 in host
    assert chain.store is not None and chain.memory is not None
    calls: list[int] = []

    def getter(i: int) -> Callable[[], bytes]:
        def get() -> bytes:
            calls.append(i)
            return raw(i)
        return get

    device = [(key(10), getter(10)), (key(0), getter(0))]  # 0 is already on disk: skipped
    written = chain.flush(device, timeout_s=WAIT_S)
    assert written == 4  # 10 from the device, 1, 2, 3 from host
    assert chain.stats.flushed_blocks == 4
    assert calls == [10]
    for i in (0, 1, 2, 3, 10):
        assert key(i) in chain.store
    chain.store.check_invariants()
    # a new disk tier on the same folder starts warm, and the bytes are right
    again = DiskTier(tmp_path / "disk", 32 * FMT.record_size, FMT)
    assert again.rebuilt == 5
    for i in (1, 10):
        assert asyncio.run(again.read(key(i))) == raw(i)


def test_flush_writes_a_block_held_by_device_and_host_once(tmp_path: Path, chains: list[TierChain]) -> None:
    chains.append(chain := make_chain(tmp_path, host_blocks=3, disk_blocks=3))
    demote_all(chain, range(2))  # both in host (the host tier is inclusive of promoted blocks)
    assert chain.store is not None
    written = chain.flush([(key(0), lambda: raw(0)), (key(1), lambda: raw(1))], timeout_s=WAIT_S)
    assert written == 2 and chain.stats.flushed_blocks == 2
    assert chain.store.stats.writes == 2
    assert len(chain.store) == 2
    chain.store.check_invariants()


def test_flush_skips_missing_payloads(chain: TierChain) -> None:
    assert chain.flush([(key(1), lambda: None)], timeout_s=WAIT_S) == 0  # type: ignore[arg-type,return-value]


def test_snapshot(chain: TierChain) -> None:
    demote_all(chain, range(3))
    snap = chain.snapshot()
    assert snap["chain"]["demotions"] == 3 and snap["chain"]["pending_writes"] == 0
    assert snap["host"]["blocks"] == 2 and snap["host"]["capacity_blocks"] == 2
    assert snap["disk"]["blocks"] == 1 and snap["disk"]["policy"] == "lru"
    assert snap["disk"]["path"].endswith(FMT.fingerprint.hex()[:16])


def test_remote_blocks_without_a_host_tier_are_staged_then_promoted_once(redis_url: str, chains: list[TierChain]) -> None:
    """With no host tier a remote load waits in the chain (the reply's own buffer) until the
    request promotes it; a promoted block leaves the staging area."""
    remote = RemoteTier(redis_url, FMT, ttl_s=120, timeout_s=5.0, mac_key=MAC_KEY)
    chains.append(chain := TierChain([remote]))
    assert chain.io is not None
    assert chain.io.submit(remote.put([(key(i), raw(i)) for i in range(5)])).result(WAIT_S)
    assert chain.prefetch("r", [], remote_keys=[key(i) for i in range(5)])
    assert poll_until(chain, ["r"]) == ["r"]
    for i in range(5):
        assert chain.on_lower_tier(key(i))
        dst = torch.zeros(NB, dtype=torch.uint8)
        assert chain.load(key(i), dst) and torch.equal(dst, block(i))
        assert not chain.on_lower_tier(key(i)) and not chain.load(key(i), dst)
    assert chain.stats.promotions == 5


def test_writes_run_on_background_threads_below_normal_priority(
        tmp_path: Path, redis_url: str, chains: list[TierChain], monkeypatch: pytest.MonkeyPatch) -> None:
    """Disk writes run on the I/O loop's writer threads and remote write payloads are sent from
    its sender thread, both niced by BACKGROUND_NICE (they must not take CPU from the step loop)."""
    import os

    from cache.tiers import ioloop as chain_module
    from cache.tiers import resp

    writers: set[str] = set()
    senders: set[str] = set()
    real_writev, real_send = os.writev, resp._send_all

    def spy_writev(fd: int, bufs: object) -> int:
        writers.add(threading.current_thread().name)
        return real_writev(fd, bufs)  # type: ignore[arg-type]

    def spy_send(sock: object, buffers: object) -> None:
        senders.add(threading.current_thread().name)
        real_send(sock, buffers)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "writev", spy_writev)
    monkeypatch.setattr(resp, "_send_all", spy_send)
    disk = DiskTier(tmp_path / "disk", 32 * FMT.record_size, FMT)
    chains.append(chain := TierChain([HostTier(2 * NB, NB), disk, RemoteTier(redis_url, FMT, timeout_s=5.0, mac_key=MAC_KEY)]))
    assert chain.io is not None
    demote_all(chain, range(6))  # 4 leave host memory for disk
    chain.write_remote([(key(i), raw(i)) for i in range(6)])
    assert chain.drain_writes(WAIT_S)
    assert len(disk) == 4 and chain.shared is not None and chain.shared.stats.puts == 6
    assert writers and all(name.startswith("kvgate-io-write") for name in writers), writers
    assert senders and all(name.startswith("kvgate-io-send") for name in senders), senders
    here = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    for pool in (chain.io.writer, chain.io.sender):
        nice = pool.submit(lambda: os.getpriority(os.PRIO_PROCESS, threading.get_native_id())).result()
        assert nice == min(19, here + chain_module.BACKGROUND_NICE)
    # the idle writer (persist = "idle") runs only on idle CPU where Linux allows it, else at nice 19
    policy, nice = chain.io.idle_writer.submit(
        lambda: (os.sched_getscheduler(0), os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))).result()
    assert policy == os.SCHED_IDLE or nice == 19
    assert os.sched_getscheduler(0) != os.SCHED_IDLE  # the caller's own thread is untouched
