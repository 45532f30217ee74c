"""Pins below the device (cache/tiers/control.py, policy.py): the book of holds and its expiry,
eviction that passes over protected keys in both policies, quotas that never take a pinned
block, a host tier whose pinned blocks survive a flood, a disk tier that keeps them while it can,
and the chain-level helpers (presence, drops)."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path

import pytest
import torch

from cache.tiers.codec import BlockFormat
from cache.tiers.control import PinBook, attach_book, drop_local, drop_stores, presence
from cache.tiers.disk import DiskTier
from cache.tiers.host import HostTier
from cache.tiers.policy import AllProtected, LRUPolicy, ProtectedPolicy, ProtectingLedger, S3FIFOPolicy

NB = 64
FMT = BlockFormat(bytes(range(32)), "float32", (2, 4))  # 32-byte payload


def key(i: int) -> bytes:
    return i.to_bytes(32, "big")


def block(seed: int) -> torch.Tensor:
    return torch.full((NB,), seed % 256, dtype=torch.uint8)


def test_the_book_counts_holders_and_expires_only_protections() -> None:
    book = PinBook()
    assert book.hold("a", [key(1), key(2)]) == 2
    assert book.hold("a", [key(2), key(3)], until=10.0) == 1  # key 2 stays pinned: a later time wins
    assert book.hold("b", [key(3)], until=20.0) == 1
    assert key(1) in book and key(4) not in book and len(book) == 3
    assert book.held_by("a") == 3 and book.held_by("b") == 1 and book.holds("a", key(2))
    assert book.is_pinned(key(2)) and not book.is_pinned(key(3))
    assert book.expire(15.0) == 1 and key(3) in book and not book.holds("a", key(3))  # b still holds it
    assert book.expire(25.0) == 1 and key(3) not in book
    assert book.snapshot().expired == 2
    book.hold("a", [key(5)], until=30.0)
    book.hold("a", [key(5)])  # pinned now: the old expiry no longer applies
    assert book.expire(40.0) == 0 and book.is_pinned(key(5))
    assert book.release("a", [key(1), key(9)]) == 1
    assert book.release_all("a") == 2 and len(book) == 0 and book.held_by("a") == 0
    assert not book.expiring or book.expire(math.inf) == 0


@pytest.mark.parametrize("inner", [LRUPolicy, S3FIFOPolicy])
def test_a_protected_policy_passes_over_protected_keys(inner: type) -> None:
    protected = {2, 3}
    policy = ProtectedPolicy(inner(8), protected.__contains__)
    for k in range(1, 6):
        policy.insert(k)
    order = [policy.evict() for _ in range(3)]
    assert sorted(order) == [1, 4, 5] and len(policy) == 2
    with pytest.raises(AllProtected):
        policy.evict()
    assert len(policy) == 2  # nothing lost on the way
    lenient = ProtectedPolicy(inner(8), protected.__contains__, strict=False)
    for k in (2, 3):
        lenient.insert(k)
    assert lenient.evict() in (2, 3) and len(lenient) == 1  # a full tier of pins gives one up


def test_a_quota_never_chooses_a_protected_block() -> None:
    protected: set[bytes] = set()
    ledger = ProtectingLedger(8, protected.__contains__)
    for i in range(4):
        ledger.add(key(i), "noisy")
    ledger.set_limit("noisy", 4)
    protected.update({key(0), key(1)})
    assert ledger.choose("noisy", key(3)) == key(2)  # at its quota: its oldest unpinned block
    assert ledger.has_unprotected("noisy")
    protected.update({key(2), key(3)})
    assert not ledger.has_unprotected("noisy")


def test_pinned_host_blocks_survive_a_flood_of_other_owners() -> None:
    tier = HostTier(NB * 8, NB)
    book = PinBook()
    tier.protected = book
    for i in range(4):
        tier.put(key(i), block(i), "quiet")
    book.hold("quiet", [key(0), key(1)])
    for i in range(100, 140):  # five times the tier, one-off blocks
        tier.put(key(i), block(i), "noisy")
        tier.check_invariants()
    assert key(0) in tier and key(1) in tier and key(2) not in tier
    assert tier.describe()["pinned"] == 2
    book.release("quiet", [key(0)])
    for i in range(200, 240):
        tier.put(key(i), block(i), "noisy")
    assert key(0) not in tier and key(1) in tier


def test_the_owners_own_unpinned_traffic_does_not_evict_its_pins() -> None:
    for policy in ("lru", "s3fifo"):
        tier = HostTier(NB * 8, NB, policy=policy)
        book = PinBook()
        tier.protected = book
        tier.put(key(1), block(1), "a")
        book.hold("a", [key(1)])
        for i in range(100, 160):
            tier.put(key(i), block(i), "a")
        assert key(1) in tier and len(tier) == 8
        tier.check_invariants()


def test_when_every_block_is_pinned_an_incoming_one_passes_through() -> None:
    tier = HostTier(NB * 4, NB)
    book = PinBook()
    tier.protected = book
    for i in range(4):
        tier.put(key(i), block(i), "a")
    book.hold("a", [key(i) for i in range(4)])
    passed = tier.put(key(9), block(9), "b")
    assert [k for k, _, _ in passed] == [key(9)] and key(9) not in tier and len(tier) == 4
    assert tier.reserve("b") is None  # no slot for a read either
    tier.check_invariants()


def test_an_owner_at_its_quota_with_only_pinned_blocks_passes_through() -> None:
    tier = HostTier(NB * 8, NB)
    book = PinBook()
    tier.protected = book
    tier.apply_quota("a", "tag", 2)
    tier.put(key(1), block(1), "a")
    tier.put(key(2), block(2), "a")
    book.hold("a", [key(1), key(2)])
    assert [k for k, _, _ in tier.put(key(3), block(3), "a")] == [key(3)]  # its own pins stay
    assert key(1) in tier and key(2) in tier and key(3) not in tier
    book.release("a", [key(1)])
    assert [k for k, _, _ in tier.put(key(3), block(3), "a")] == [key(1)]  # the unpinned one goes
    tier.check_invariants()


def test_a_disk_tier_keeps_pinned_blocks_while_it_can(tmp_path: Path) -> None:
    disk = DiskTier(tmp_path, 4 * FMT.record_size, FMT)
    book = PinBook()
    disk.protected = book

    def write(i: int, owner: str = "a") -> bool:
        return asyncio.run(disk.write(key(i), bytes([i]) * FMT.payload_size, owner))

    for i in range(4):
        write(i)
    book.hold("a", [key(0)])
    for i in range(10, 20):
        write(i, "b")
    assert key(0) in disk and disk.keys_of("a") == [key(0)]
    disk.check_invariants()


def test_presence_and_drops_read_every_tier(tmp_path: Path) -> None:
    class Chain:  # what the helpers read of a `TierChain`
        def __init__(self) -> None:
            self.memory = HostTier(NB * 4, NB)
            self.stores = [DiskTier(tmp_path, 8 * FMT.record_size, FMT)]
            self.tiers = [self.memory, *self.stores]

        def on_lower_tier(self, k: bytes) -> bool:
            return k in self.memory

    chain = Chain()
    chain.memory.put(key(1), block(1))
    for i in (1, 2):
        asyncio.run(chain.stores[0].write(key(i), bytes([i]) * FMT.payload_size))
    found = presence(chain, [key(0), key(1), key(2), key(3)], on_device=lambda k: k == key(0))
    assert found.rows == [["device"], ["host", "disk"], ["disk"], []]
    assert found.leading() == 3 and found.by_tier() == {"device": 1, "host": 1, "disk": 1}
    assert found.blocks() == {"device": 1, "host": 1, "disk": 2}
    found.add_remote("remote", [False, False, True, True])
    assert found.leading() == 4 and found.by_tier()["remote"] == 1
    book = PinBook()
    attach_book(chain, book)
    assert chain.memory.protected is book and chain.stores[0].protected is book
    assert drop_local(chain, [key(1), key(2)]) == 1

    async def drop() -> dict[str, int]:
        return await drop_stores(chain, chain.stores, [key(1), key(2), key(3)])

    assert asyncio.run(drop()) == {"disk": 2}
    assert len(chain.stores[0]) == 0 and not list(tmp_path.rglob("*.kvb"))
