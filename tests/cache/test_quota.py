"""Per-tenant block quotas in every tier (`cache.quota`): an owner at its quota gives up its own
blocks first, and a flooding owner never pushes another below its fair share — in the ledger,
the device pool, the host slab, the disk folder and (across replicas) the remote store."""

from __future__ import annotations

import asyncio
from pathlib import Path

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cache.block_pool import BlockPool
from cache.quota import PUBLIC, UNKNOWN, QuotaLedger, pick_victim
from cache.tiers.codec import BlockFormat
from cache.tiers.disk import DiskTier
from cache.tiers.host import HostTier
from cache.tiers.policy import make_policy
from cache.tiers.remote import RemoteTier

MAC_KEY = bytes(range(100, 132))  # the store key every replica of a test deployment shares

NB = 64
FMT = BlockFormat(bytes(range(32)), "float32", (2, 4))  # 32-byte payload


def key(i: int) -> bytes:
    return i.to_bytes(32, "big")


def block(seed: int) -> torch.Tensor:
    return torch.arange(NB, dtype=torch.uint8) * 7 + seed


# ---- the ledger ---------------------------------------------------------------------------------
def test_without_limits_the_policy_decides() -> None:
    ledger = QuotaLedger(4)
    for i in range(4):
        ledger.add(i, "noisy")
    assert not ledger.active
    assert ledger.choose("quiet", 2) == 2


def test_an_owner_at_its_quota_gives_up_its_own_oldest_first() -> None:
    ledger = QuotaLedger(10)
    ledger.set_limit("noisy", 3)
    ledger.add("q1", "quiet")
    for name in ("n1", "n2", "n3"):
        ledger.add(name, "noisy")
    ledger.touch("n1")  # n2 is now noisy's least recently used
    assert ledger.at_quota("noisy") and not ledger.at_quota("quiet")
    assert ledger.choose("noisy", "q1") == "n2"
    assert ledger.own_evictions == 1


def test_a_protected_owner_is_spared_and_the_biggest_surplus_pays() -> None:
    ledger = QuotaLedger(6)  # 3 owners → fair share 2
    ledger.set_limit("noisy", 100)
    ledger.add("q1", "quiet")
    ledger.add("q2", "quiet")
    for name in ("n1", "n2", "n3"):
        ledger.add(name, "noisy")
    ledger.add("p1", PUBLIC)
    assert ledger.fair_share() == 2
    # the policy would take quiet's block; quiet holds its fair share: noisy's oldest goes instead
    assert ledger.choose("noisy", "q1") == "n1"
    assert ledger.protected_skips == 1
    # an unowned block (found on disk after a restart) may always go
    ledger.add("u1", UNKNOWN)
    assert ledger.choose("noisy", "u1") == "u1"


def test_quota_zero_admits_nothing() -> None:
    ledger = QuotaLedger(4)
    ledger.set_limit("t", 0)
    assert not ledger.admits("t") and ledger.admits("other")
    ledger.set_limit("t", None)
    assert ledger.admits("t") and not ledger.active


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["noisy", "quiet", PUBLIC]), st.integers(0, 40)), max_size=200),
       st.sampled_from(["lru", "s3fifo"]))
def test_a_flooding_owner_never_pushes_another_below_its_allowance(ops, policy_name) -> None:
    """Random puts into a full tier: noisy (quota 5) never takes a block from an owner holding no
    more than its allowance, and never holds more than its quota after its own put."""
    capacity = 12
    ledger, policy = QuotaLedger(capacity), make_policy(policy_name, capacity)
    ledger.set_limit("noisy", 5)
    for owner, n in ops:
        k = (owner, n)
        if ledger.owner_of(k) is not None:
            ledger.touch(k)
            policy.touch(k)
            continue
        if len(ledger) >= capacity or ledger.at_quota(owner):
            before = ledger.counts()
            victim = pick_victim(policy, ledger, owner)
            holder = ledger.remove(victim)
            assert holder is not None
            if holder != owner:  # someone else paid: it held more than its allowance
                assert before[holder] > min(ledger.limit(holder) or capacity, capacity // len(before))
        ledger.add(k, owner)
        policy.insert(k)
        assert ledger.count("noisy") <= 5
        assert len(ledger) == len(policy) <= capacity


# ---- device pool ------------------------------------------------------------------------------
def _store(pool: BlockPool, owner: str, first_key: int, n: int) -> None:
    """One request of ``owner``: ``n`` blocks computed, published, then let go (idle, cached)."""
    blocks = pool.get_new_blocks(n, owner)
    assert blocks is not None
    for i, b in enumerate(blocks):
        pool.cache_block(b, key(first_key + i), owner)
    pool.free_blocks(reversed(blocks))
    pool.check_invariants()


def _quiet_survives_a_flood(noisy_quota: int | None) -> bool:
    """Quiet stores 4 blocks, then noisy sends ten 6-block requests into a 16-block pool."""
    pool = BlockPool(16)
    pool.ledger.set_limit("noisy", noisy_quota)
    _store(pool, "quiet", 100, 4)
    for round_ in range(10):
        _store(pool, "noisy", 1000 * round_, 6)
        if noisy_quota is not None:
            assert pool.ledger.count("noisy") <= noisy_quota
    kept = [pool.get_cached_block(key(100 + i)) is not None for i in range(4)]
    assert all(kept) or not any(kept), kept
    return all(kept)


def test_device_pool_flood_keeps_the_quiet_tenants_idle_blocks() -> None:
    assert _quiet_survives_a_flood(noisy_quota=4)


def test_device_pool_without_quotas_evicts_lru_first() -> None:
    """The control: with no quota the same flood evicts the quiet tenant's blocks."""
    assert not _quiet_survives_a_flood(noisy_quota=None)


def test_device_quota_never_takes_blocks_a_request_holds() -> None:
    pool = BlockPool(8)
    pool.ledger.set_limit("t", 1)
    held = pool.get_new_blocks(3, "t")
    assert held is not None
    for i, b in enumerate(held):
        pool.cache_block(b, key(i), "t")  # over quota, but every block is in use: all stay cached
    assert pool.num_cached_blocks == 3
    pool.free_blocks(reversed(held))
    fresh = pool.get_new_blocks(1, "t")  # at quota: its own idle blocks go first
    assert fresh is not None
    pool.check_invariants()


# ---- host tier ----------------------------------------------------------------------------------
def test_host_tier_quota_caps_the_owner_and_spares_the_quiet_one() -> None:
    tier = HostTier(8 * NB, NB)
    tier.ledger.set_limit("noisy", 3)
    for i in range(2):
        assert tier.put(key(100 + i), block(i), "quiet") == []
    passed_down = []
    for i in range(20):
        passed_down += tier.put(key(i), block(i), "noisy")
        tier.check_invariants()
        assert tier.ledger.count("noisy") <= 3
    assert key(100) in tier and key(101) in tier
    assert {owner for _, _, owner in passed_down} == {"noisy"}  # evicted blocks keep their owner
    assert len(passed_down) == 17


def test_host_tier_quota_zero_passes_blocks_through() -> None:
    tier = HostTier(4 * NB, NB)
    tier.ledger.set_limit("t", 0)
    out = tier.put(key(1), block(1), "t")
    assert out == [(key(1), block(1).numpy().tobytes(), "t")] and key(1) not in tier


# ---- disk tier ----------------------------------------------------------------------------------
def test_disk_tier_quota_and_fair_share(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, 6 * FMT.record_size, FMT)
    tier.ledger.set_limit("noisy", 2)
    payload = bytes(FMT.payload_size)

    async def main() -> None:
        for i in range(3):
            assert await tier.write(key(100 + i), payload, "quiet")
        for i in range(10):
            assert await tier.write(key(i), payload, "noisy")
            assert tier.ledger.count("noisy") <= 2

    asyncio.run(main())
    tier.check_invariants()
    assert all(key(100 + i) in tier for i in range(3))
    assert sorted(p.name for p in tier.dir.iterdir()) == sorted(
        k.hex() + ".kvb" for k in (key(100), key(101), key(102), key(8), key(9)))


def test_disk_blocks_found_at_start_are_unowned_and_go_first(tmp_path: Path) -> None:
    payload = bytes(FMT.payload_size)
    first = DiskTier(tmp_path, 3 * FMT.record_size, FMT)
    for i in range(3):
        asyncio.run(first.write(key(i), payload, "someone"))
    again = DiskTier(tmp_path, 3 * FMT.record_size, FMT)
    assert again.ledger.counts() == {UNKNOWN: 3}
    again.ledger.set_limit("t", 10)
    asyncio.run(again.write(key(50), payload, "t"))
    assert again.ledger.counts() == {UNKNOWN: 2, "t": 1}


# ---- remote tier ------------------------------------------------------------------------------
def test_remote_quota_is_kept_in_redis_for_every_replica(redis_url, redis_server) -> None:
    """Two tiers on one store (two replicas) account one owner under one opaque tag: past the
    quota the oldest blocks are deleted from Redis; another owner's blocks are untouched."""
    payload = bytes(FMT.payload_size)

    async def main() -> None:
        a, b = RemoteTier(redis_url, FMT, ttl_s=600, mac_key=MAC_KEY), RemoteTier(redis_url, FMT, ttl_s=600, mac_key=MAC_KEY)
        try:
            for tier in (a, b):
                tier.set_account("noisy", "tag0123", 3)
            assert await a.put([(key(100), payload)], "quiet") == 1  # not accounted: no quota
            assert await a.put([(key(1), payload), (key(2), payload)], "noisy") == 2
            await asyncio.sleep(0.01)
            assert await b.put([(key(3), payload), (key(4), payload)], "noisy") == 2
            assert await a.exists([key(1), key(2), key(3), key(4), key(100)]) == [False, True, True, True, True]
            assert a.quota_evictions + b.quota_evictions == 1
            assert [*a.unstored, *b.unstored] == [key(1)]  # the chain forgets it sent it: a later write resends
            b.set_account("zero", "tagzero", 0)
            assert await b.put([(key(7), payload)], "zero") == 0
            assert await b.exists([key(7)]) == [False]
        finally:
            await a.close()
            await b.close()

    asyncio.run(main())
    with redis_server.client() as client:
        names = [k.decode() for k in client.keys("*owner*")]
        assert names == [f"kvgate:{FMT.fingerprint.hex()}:owner:tag0123"]
        assert client.zcard(names[0]) == 3 and client.ttl(names[0]) > 0
