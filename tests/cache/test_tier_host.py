"""HostTier: a slab of uint8 slots in CPU memory; bytes in and out exactly, bounded, counted."""

from __future__ import annotations

from collections import OrderedDict

import numpy
import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from cache.tiers.host import HostTier

NB = 64  # bytes per block


def key(i: int) -> bytes:
    return i.to_bytes(32, "big")


def block(seed: int, nbytes: int = NB) -> torch.Tensor:
    return torch.tensor([(seed * 31 + j * 7) % 256 for j in range(nbytes)], dtype=torch.uint8)


def load(tier: HostTier, k: bytes) -> torch.Tensor | None:
    dst = torch.full((tier.block_nbytes,), 0xAA, dtype=torch.uint8)
    return dst if tier.load_into(k, dst) else None


def test_capacity_from_bytes() -> None:
    assert HostTier(NB * 4 + NB - 1, NB).capacity_blocks == 4
    with pytest.raises(ValueError, match="holds no block"):
        HostTier(NB - 1, NB)


def test_put_load_round_trip() -> None:
    tier = HostTier(NB * 4, NB)
    assert tier.put(key(1), block(1)) == []
    assert tier.put(key(2), block(2)) == []
    assert key(1) in tier and key(2) in tier and key(3) not in tier
    assert len(tier) == 2 and tier.nbytes == 2 * NB
    out = load(tier, key(1))
    assert out is not None and torch.equal(out, block(1))
    out = load(tier, key(2))
    assert out is not None and torch.equal(out, block(2))
    assert tier.payload(key(2)) == block(2).numpy().tobytes()
    assert tier.payload(key(3)) is None
    tier.check_invariants()


def test_source_is_copied_not_aliased() -> None:
    tier = HostTier(NB * 2, NB)
    src = block(5)
    tier.put(key(5), src)
    src.zero_()
    out = load(tier, key(5))
    assert out is not None and torch.equal(out, block(5))


def test_put_bytes_readonly_and_writable() -> None:
    tier = HostTier(NB * 4, NB)
    tier.put_bytes(key(1), block(1).numpy().tobytes())  # bytes: read-only buffer
    tier.put_bytes(key(2), bytearray(block(2).numpy().tobytes()))
    tier.put_bytes(key(3), memoryview(block(3).numpy().tobytes()))
    reply = numpy.frombuffer(b"header" + block(4).numpy().tobytes(), dtype=numpy.uint8).copy()
    tier.put_bytes(key(4), memoryview(reply)[6:])  # a Redis reply: a writable view past the header
    reply[:] = 0  # the tier copied it: the reply's buffer is reused or freed afterwards
    for i in (1, 2, 3, 4):
        out = load(tier, key(i))
        assert out is not None and torch.equal(out, block(i))


def test_put_of_a_present_key_keeps_the_stored_bytes() -> None:
    tier = HostTier(NB * 2, NB)
    tier.put(key(1), block(1))
    assert tier.put(key(1), block(9)) == []  # same hash → same KV: nothing copied
    assert len(tier) == 1 and tier.stats.puts == 1
    out = load(tier, key(1))
    assert out is not None and torch.equal(out, block(1))


def test_miss() -> None:
    tier = HostTier(NB * 2, NB)
    dst = torch.full((NB,), 0xAA, dtype=torch.uint8)
    assert not tier.load_into(key(1), dst)
    assert torch.all(dst == 0xAA)  # untouched
    assert tier.stats.misses == 1 and tier.stats.hits == 0


def test_capacity_never_exceeded_and_eviction_returns_victim_bytes() -> None:
    tier = HostTier(NB * 3, NB)  # LRU
    for i in range(3):
        assert tier.put(key(i), block(i)) == []
    assert load(tier, key(0)) is not None  # 0 becomes most recent; 1 is the LRU block
    evicted = tier.put(key(3), block(3))
    assert evicted == [(key(1), block(1).numpy().tobytes(), "")]
    assert len(tier) == 3 and key(1) not in tier
    for i in range(4, 20):
        evicted = tier.put(key(i), block(i))
        assert len(evicted) == 1
        victim, payload, _ = evicted[0]
        assert payload == block(int.from_bytes(victim, "big")).numpy().tobytes()
        assert victim not in tier
        assert len(tier) == tier.capacity_blocks == 3
        tier.check_invariants()
    assert tier.stats.evictions == 17


def test_delete_and_clear() -> None:
    tier = HostTier(NB * 3, NB)
    for i in range(3):
        tier.put(key(i), block(i))
    assert tier.delete(key(1))
    assert not tier.delete(key(1))
    assert key(1) not in tier and len(tier) == 2
    assert load(tier, key(1)) is None
    assert tier.put(key(7), block(7)) == []  # the freed slot is reused: no eviction
    tier.check_invariants()
    assert sorted(tier.keys()) == sorted([key(0), key(2), key(7)])
    assert tier.clear() == 3
    assert len(tier) == 0 and tier.nbytes == 0 and list(tier.keys()) == []
    tier.check_invariants()
    for i in range(3):  # every slot is free again
        assert tier.put(key(10 + i), block(10 + i)) == []
    tier.check_invariants()


def test_stats_counters() -> None:
    tier = HostTier(NB * 2, NB)
    tier.put(key(1), block(1))
    tier.put(key(2), block(2))
    tier.put(key(3), block(3))  # evicts 1
    load(tier, key(2))
    load(tier, key(3))
    load(tier, key(1))  # miss
    s = tier.stats
    assert (s.puts, s.writes, s.bytes_written) == (3, 3, 3 * NB)
    assert (s.hits, s.reads, s.bytes_read, s.misses) == (2, 2, 2 * NB, 1)
    assert s.evictions == 1
    assert s.read_time_s >= 0 and s.write_time_s >= 0
    assert s.snapshot()["hits"] == 2


@pytest.mark.parametrize("policy", ["lru", "s3fifo"])
def test_many_puts_stay_bounded(policy: str) -> None:
    tier = HostTier(NB * 5, NB, policy=policy)
    for i in range(50):
        tier.put(key(i % 13), block(i % 13))
        if i % 3 == 0:
            load(tier, key(i % 7))
        assert len(tier) <= 5
        tier.check_invariants()


class HostMachine(RuleBasedStateMachine):
    """Random puts, loads, deletes and clears against a shadow dict (exact LRU order for "lru")."""

    @initialize(policy=st.sampled_from(["lru", "s3fifo"]), capacity=st.integers(1, 6))
    def setup(self, policy: str, capacity: int) -> None:
        self.tier = HostTier(NB * capacity, NB, policy=policy)
        self.policy = policy
        self.shadow: OrderedDict[bytes, bytes] = OrderedDict()  # LRU → MRU

    @rule(i=st.integers(0, 9), seed=st.integers(0, 255))
    def put(self, i: int, seed: int) -> None:
        k = key(i)
        present = k in self.shadow
        evicted = self.tier.put(k, block(seed))
        if present:
            assert evicted == []
            self.shadow.move_to_end(k)
            return
        if len(self.shadow) < self.tier.capacity_blocks:
            assert evicted == []
        else:
            assert len(evicted) == 1
            victim, payload, _ = evicted[0]
            assert victim in self.shadow and victim != k
            if self.policy == "lru":
                assert victim == next(iter(self.shadow))
            assert payload == self.shadow.pop(victim)
        self.shadow[k] = block(seed).numpy().tobytes()

    @rule(i=st.integers(0, 9))
    def load(self, i: int) -> None:
        k = key(i)
        hits, misses = self.tier.stats.hits, self.tier.stats.misses
        out = load(self.tier, k)
        if k in self.shadow:
            assert out is not None and out.numpy().tobytes() == self.shadow[k]
            assert self.tier.stats.hits == hits + 1
            self.shadow.move_to_end(k)
        else:
            assert out is None and self.tier.stats.misses == misses + 1

    @rule(i=st.integers(0, 9))
    def delete(self, i: int) -> None:
        k = key(i)
        assert self.tier.delete(k) == (k in self.shadow)
        self.shadow.pop(k, None)

    @rule()
    def clear(self) -> None:
        assert self.tier.clear() == len(self.shadow)
        self.shadow.clear()

    @invariant()
    def consistent(self) -> None:
        self.tier.check_invariants()
        assert len(self.tier) == len(self.shadow) <= self.tier.capacity_blocks
        assert set(self.tier.keys()) == set(self.shadow)
        for k, payload in self.shadow.items():
            assert self.tier.payload(k) == payload


HostMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)
TestHostMachine = HostMachine.TestCase


def test_reserve_commit_release() -> None:
    """Slots a disk read fills: outside the index until committed; released ones are free again."""
    tier = HostTier(NB * 3, NB)
    tier.put(key(1), block(1))
    got = tier.reserve()
    assert got is not None
    slot, view, evicted = got
    assert evicted == [] and view.nbytes == NB and not view.readonly
    view[:] = block(7).numpy().tobytes()
    assert key(7) not in tier and len(tier) == 1
    tier.check_invariants()
    assert tier.commit(key(7), slot) == []
    out = load(tier, key(7))
    assert out is not None and torch.equal(out, block(7))
    tier.check_invariants()
    # a full tier evicts for a reservation; a failed read releases its slot
    got = tier.reserve()
    assert got is not None and got[2] == []
    again = tier.reserve()
    assert again is not None and len(again[2]) == 1 and again[2][0][0] == key(1)
    tier.release(got[0])
    tier.release(again[0])
    assert len(tier) == 1 and key(7) in tier
    tier.check_invariants()
    # when every slot is reserved, there is nothing to evict: no reservation
    small = HostTier(NB * 2, NB)
    assert small.reserve() is not None and small.reserve() is not None
    assert small.reserve() is None
    passed = small.put(key(5), block(5))  # no room and nothing to evict: straight through
    assert passed == [(key(5), block(5).numpy().tobytes(), "")] and key(5) not in small
    small.check_invariants()


def test_commit_of_a_block_that_arrived_meanwhile_frees_the_slot() -> None:
    tier = HostTier(NB * 2, NB)
    got = tier.reserve()
    assert got is not None
    tier.put(key(1), block(1))
    assert tier.commit(key(1), got[0]) == []
    assert len(tier) == 1
    tier.check_invariants()


def test_reserve_respects_a_zero_quota_and_commit_the_quota() -> None:
    tier = HostTier(NB * 4, NB)
    tier.ledger.set_limit("t", 0)
    assert tier.reserve("t") is None
    tier.ledger.set_limit("u", 1)
    first = tier.reserve("u")
    second = tier.reserve("u")
    assert first is not None and second is not None
    assert tier.commit(key(1), first[0], "u") == []
    evicted = tier.commit(key(2), second[0], "u")  # at its quota: its own block leaves
    assert [e[0] for e in evicted] == [key(1)] and key(2) in tier and key(1) not in tier
    tier.check_invariants()


# ---- a host tier sharing the device pool's slab: blocks move by trading rows ---------------------

def shared_tier(pool_rows: int, host_rows: int, policy: str = "lru") -> tuple[HostTier, torch.Tensor]:
    slab = torch.zeros((pool_rows + host_rows, NB), dtype=torch.uint8)
    return HostTier(0, NB, policy, slab=slab, rows=range(pool_rows, pool_rows + host_rows)), slab


def test_a_shared_tier_takes_and_gives_rows_without_copying() -> None:
    tier, slab = shared_tier(2, 3)
    assert tier.shared and tier.capacity_blocks == 3 and tier.rows() == {2, 3, 4}
    slab[0] = block(1)
    got = tier.adopt(key(1), 0)
    assert got is not None
    spare, evicted = got
    assert evicted == [] and spare in (2, 3, 4) and tier.rows() == {0, 2, 3, 4} - {spare}
    assert tier.payload(key(1)) == block(1).numpy().tobytes()  # the very row the pool wrote
    assert (tier.stats.handovers, tier.stats.bytes_written, tier.stats.puts) == (1, 0, 1)
    assert tier.adopt(key(1), 1) == (1, [])  # already here: the pool keeps its own row
    held = tier.surrender(key(1), spare)
    assert held == 0 and key(1) not in tier and tier.rows() == {2, 3, 4}
    assert (tier.stats.hits, tier.stats.handovers, tier.stats.bytes_read) == (1, 2, 0)
    assert tier.surrender(key(1), 5) is None  # a miss: nothing traded
    tier.check_invariants()


def test_a_full_shared_tier_evicts_the_victims_bytes_for_the_row_it_gives() -> None:
    tier, slab = shared_tier(4, 2)
    for i in range(3):
        slab[i] = block(i)
    rows = {}
    for i in range(3):
        got = tier.adopt(key(i), i)
        assert got is not None
        rows[i] = got[0]
        if i < 2:
            assert got[1] == []
        else:  # the least recently used block leaves as bytes; its row goes to the pool
            assert got[1] == [(key(0), block(0).numpy().tobytes(), "")] and got[0] == 0
    assert len(tier) == 2 and tier.rows() == {1, 2}
    tier.check_invariants()


def test_a_shared_tier_refuses_what_it_may_not_hold() -> None:
    tier, _ = shared_tier(1, 2)
    tier.ledger.set_limit("t", 0)
    assert tier.adopt(key(1), 0, "t") is None  # no host quota: `put` passes it on as bytes
    assert tier.reserve() is not None and tier.reserve() is not None
    assert tier.adopt(key(2), 0) is None  # every row is being filled by a read
    tier.check_invariants()


def test_a_shared_slab_must_fit_the_blocks() -> None:
    with pytest.raises(ValueError, match="must be"):
        HostTier(0, NB, slab=torch.zeros((4, NB + 1), dtype=torch.uint8), rows=[0, 1])
    with pytest.raises(ValueError, match="holds no block"):
        HostTier(0, NB, slab=torch.zeros((4, NB), dtype=torch.uint8), rows=[])


class SharedHostMachine(RuleBasedStateMachine):
    """A pool of rows and a shared host tier trading them: demotions, promotions, copies in,
    reads into reserved rows. Every row has exactly one owner, and every block's bytes are where
    the pool or the tier says."""

    @initialize(policy=st.sampled_from(["lru", "s3fifo"]), pool=st.integers(1, 4), host=st.integers(1, 5))
    def setup(self, policy: str, pool: int, host: int) -> None:
        self.tier, self.slab = shared_tier(pool, host, policy)
        self.pool = {b: b for b in range(pool)}  # pool block → its row
        self.pool_holds: dict[int, bytes] = {}  # pool block → key of the block in it
        self.shadow: dict[bytes, bytes] = {}  # what the tier must hold
        self.reserved: list[int] = []

    def _bytes(self, k: bytes) -> bytes:
        return block(k[-1]).numpy().tobytes()

    @rule(b=st.integers(0, 3), i=st.integers(0, 7))
    def compute(self, b: int, i: int) -> None:
        """A pool block gets new KV (its old block was demoted first)."""
        if b not in self.pool:
            return
        self.demote(b)
        self.slab[self.pool[b]] = block(i)
        self.pool_holds[b] = key(i)

    @rule(b=st.integers(0, 3))
    def demote(self, b: int) -> None:
        k = self.pool_holds.pop(b, None)
        if b not in self.pool or k is None:
            return
        got = self.tier.adopt(k, self.pool[b])
        if got is None:  # (every row reserved) it passes through as bytes
            assert all(r in self.reserved for r in self.tier.rows())
            return
        self.pool[b], evicted = got
        for victim, payload, _ in evicted:
            assert payload == self.shadow.pop(victim)
        self.shadow[k] = self._bytes(k)

    @rule(b=st.integers(0, 3), i=st.integers(0, 7))
    def promote(self, b: int, i: int) -> None:
        if b not in self.pool:
            return
        self.demote(b)
        held = self.tier.surrender(key(i), self.pool[b])
        assert (held is None) == (key(i) not in self.shadow)
        if held is not None:
            self.pool[b] = held
            self.pool_holds[b] = key(i)
            del self.shadow[key(i)]

    @rule(i=st.integers(0, 7))
    def put(self, i: int) -> None:
        for victim, payload, _ in self.tier.put(key(i), block(i)):
            if victim != key(i):
                assert payload == self.shadow.pop(victim)
            else:
                return
        self.shadow[key(i)] = self._bytes(key(i))

    @rule(i=st.integers(0, 7), fail=st.booleans())
    def read(self, i: int, fail: bool) -> None:
        got = self.tier.reserve()
        if got is None:
            return
        row, view, evicted = got
        for victim, payload, _ in evicted:
            assert payload == self.shadow.pop(victim)
        if fail:
            self.tier.release(row)
            return
        view[:] = self._bytes(key(i))
        for victim, payload, _ in self.tier.commit(key(i), row):
            assert payload == self.shadow.pop(victim)
        self.shadow[key(i)] = self._bytes(key(i))

    @invariant()
    def consistent(self) -> None:
        self.tier.check_invariants()
        owners = sorted([*self.pool.values(), *self.tier.rows()])
        assert owners == list(range(self.slab.shape[0]))
        assert set(self.tier.keys()) == set(self.shadow)
        for k, payload in self.shadow.items():
            assert self.tier.payload(k) == payload
        for b, k in self.pool_holds.items():
            assert self.slab[self.pool[b]].numpy().tobytes() == self._bytes(k)


SharedHostMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)
TestSharedHostMachine = SharedHostMachine.TestCase


def test_the_pool_never_gets_a_row_of_leftover_bytes() -> None:
    """Rows never written (torch.empty) or left by a failed read are zeroed before the pool takes
    one: a partly filled block must not hand attention NaN garbage (0 · NaN is NaN)."""
    tier, slab = shared_tier(1, 3)
    slab.fill_(0xFF)  # as float32 this is NaN everywhere
    slab[0] = block(1)
    got = tier.adopt(key(1), 0)  # the pool gets a row never written
    assert got is not None and int(slab[got[0]].count_nonzero()) == 0
    held = tier.surrender(key(1), got[0])  # back: that (clean) row is a free row of the tier again
    assert held == 0
    reserved = tier.reserve()
    assert reserved is not None and reserved[0] == got[0]
    reserved[1][:] = b"\xff" * NB  # a damaged read's bytes, then the read fails
    tier.release(reserved[0])
    again = tier.adopt(key(1), 0)
    assert again is not None and again[0] == got[0]
    assert int(slab[again[0]].count_nonzero()) == 0, "a failed read's leftovers reached the pool"
    tier.check_invariants()
