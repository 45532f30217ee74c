"""Eviction policies: LRU order, S3-FIFO scan resistance, and bookkeeping under random operations."""

from __future__ import annotations

from collections.abc import Hashable, Iterable

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from cache.tiers.policy import POLICIES, EvictionPolicy, LRUPolicy, S3FIFOPolicy, make_policy


def drain(policy: EvictionPolicy) -> list[Hashable]:
    out = []
    while len(policy):
        out.append(policy.evict())
    return out


class Cache:
    """A fixed-capacity cache driven by a policy, the way the tiers use one."""

    def __init__(self, policy: EvictionPolicy, capacity: int) -> None:
        self.policy = policy
        self.capacity = capacity
        self.keys: set[Hashable] = set()
        self.hits = 0

    def access(self, key: Hashable) -> bool:
        if key in self.keys:
            self.policy.touch(key)
            self.hits += 1
            return True
        if len(self.keys) >= self.capacity:
            victim = self.policy.evict()
            assert victim in self.keys
            self.keys.remove(victim)
        self.policy.insert(key)
        self.keys.add(key)
        assert len(self.policy) == len(self.keys) <= self.capacity
        return False

    def run(self, keys: Iterable[Hashable]) -> None:
        for key in keys:
            self.access(key)


# ---- LRU ------------------------------------------------------------------------------------


def test_lru_evicts_least_recently_used_first() -> None:
    p = LRUPolicy(8)
    for k in "abcde":
        p.insert(k)
    p.touch("a")
    p.touch("c")
    assert drain(p) == ["b", "d", "e", "a", "c"]


def test_lru_reinsert_refreshes_and_touch_of_unknown_is_noop() -> None:
    p = LRUPolicy(8)
    for k in "abc":
        p.insert(k)
    p.insert("a")  # already there: becomes most recent, not duplicated
    p.touch("zz")
    assert len(p) == 3
    assert drain(p) == ["b", "c", "a"]


def test_lru_remove() -> None:
    p = LRUPolicy(8)
    for k in "abc":
        p.insert(k)
    p.remove("a")
    p.remove("missing")
    assert len(p) == 2
    assert drain(p) == ["b", "c"]


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_evict_on_empty_raises(name: str) -> None:
    with pytest.raises(KeyError):
        make_policy(name, 4).evict()


def test_make_policy() -> None:
    assert isinstance(make_policy("lru", 4), LRUPolicy)
    assert isinstance(make_policy("s3fifo", 4), S3FIFOPolicy)
    with pytest.raises(ValueError, match="unknown eviction policy"):
        make_policy("lfu", 4)


# ---- S3-FIFO --------------------------------------------------------------------------------


def test_s3fifo_one_off_keys_leave_in_fifo_order() -> None:
    p = S3FIFOPolicy(10)
    for k in range(5):
        p.insert(k)
    assert drain(p) == [0, 1, 2, 3, 4]


def test_s3fifo_ghost_hit_goes_to_main() -> None:
    p = S3FIFOPolicy(10)  # small queue of 1
    p.insert("a")
    assert p.evict() == "a"  # seen once: out, remembered as a ghost
    p.insert("a")  # seen again while a ghost: straight to main
    for k in "bcd":
        p.insert(k)
    # the small queue is drained first while it is at its size; "a" sits in main
    assert drain(p) == ["b", "c", "d", "a"]


def test_s3fifo_hot_set_survives_a_scan_that_flushes_lru() -> None:
    capacity, hot = 10, [f"hot{i}" for i in range(5)]
    scan = [f"scan{i}" for i in range(200)]
    results = {}
    for name in ("lru", "s3fifo"):
        cache = Cache(make_policy(name, capacity), capacity)
        cache.run(hot * 3)  # inserted, then hit twice each: the working set
        assert cache.keys == set(hot)
        hot_hits = 0
        for i in range(0, len(scan), 20):  # 20 one-off keys (twice the capacity), then the hot set
            cache.run(scan[i:i + 20])
            hot_hits += sum(cache.access(k) for k in hot)
        results[name] = (hot_hits, set(hot) <= cache.keys)
    rounds = len(scan) // 20
    # LRU: every burst of 20 new keys pushes all of the hot set out, so each hot access misses.
    assert results["lru"] == (0, True)  # (present at the end only because just re-inserted)
    # S3-FIFO: the hot keys were promoted to main on their first eviction pass and stay there.
    assert results["s3fifo"] == (rounds * len(hot), True)


def test_s3fifo_hot_set_resident_after_a_pure_scan() -> None:
    capacity, hot = 10, [f"hot{i}" for i in range(5)]
    resident = {}
    for name in ("lru", "s3fifo"):
        cache = Cache(make_policy(name, capacity), capacity)
        cache.run(hot * 3)
        cache.run(f"scan{i}" for i in range(100))
        resident[name] = set(hot) & cache.keys
    assert resident == {"lru": set(), "s3fifo": set(hot)}


def test_s3fifo_remove_and_reinsert() -> None:
    p = S3FIFOPolicy(10)
    for k in "abc":
        p.insert(k)
    p.touch("a")
    p.remove("a")
    p.remove("nope")
    assert len(p) == 2
    p.insert("a")  # a fresh key again: count starts from zero
    assert drain(p) == ["b", "c", "a"]


# ---- random operations, both policies ---------------------------------------------------------

KEYS = st.integers(0, 15)


class PolicyMachine(RuleBasedStateMachine):
    @initialize(name=st.sampled_from(sorted(POLICIES)), capacity=st.integers(1, 24))
    def setup(self, name: str, capacity: int) -> None:
        self.policy = make_policy(name, capacity)
        self.shadow: set[int] = set()
        self.removed: set[int] = set()  # removed and not inserted since

    @rule(key=KEYS)
    def insert(self, key: int) -> None:
        self.policy.insert(key)
        self.shadow.add(key)
        self.removed.discard(key)

    @rule(key=KEYS)
    def touch(self, key: int) -> None:
        self.policy.touch(key)

    @rule(key=KEYS)
    def remove(self, key: int) -> None:
        self.policy.remove(key)
        if key in self.shadow:
            self.shadow.remove(key)
            self.removed.add(key)

    @precondition(lambda self: self.shadow)
    @rule()
    def evict(self) -> None:
        victim = self.policy.evict()
        assert victim in self.shadow, (victim, self.shadow)
        assert victim not in self.removed
        self.shadow.remove(victim)

    @rule()
    def evict_all(self) -> None:
        victims = drain(self.policy)
        assert len(victims) == len(set(victims))
        assert set(victims) == self.shadow
        self.shadow.clear()

    @invariant()
    def sizes_agree(self) -> None:
        assert len(self.policy) == len(self.shadow)


PolicyMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=60, deadline=None)
TestPolicyMachine = PolicyMachine.TestCase
