"""KVCacheManager.promote (lower-tier blocks into the device pool) and BlockPool.on_evict / hold."""

from __future__ import annotations

import pytest

from cache.block_pool import Block, BlockPool
from cache.hashing import BlockHash, extend_block_hashes, root_hash
from cache.manager import KVCacheManager

BS = 4
ROOT = root_hash(b"ns", b"model")


def hashes(tokens: list[int]) -> list[BlockHash]:
    return extend_block_hashes([], ROOT, tokens, BS)


class FakeTier:
    """A lower tier backed by a dict; ``device`` is what each device block was filled with."""

    def __init__(self, store: dict[BlockHash, bytes]) -> None:
        self.store = store
        self.device: dict[int, bytes] = {}
        self.calls: list[BlockHash] = []

    def load(self, block_hash: BlockHash, block_id: int) -> bool:
        self.calls.append(block_hash)
        if block_hash not in self.store:
            return False
        self.device[block_id] = self.store[block_hash]
        return True


class EvictLog:
    def __init__(self, pool: BlockPool) -> None:
        self.calls: list[tuple[int, BlockHash, BlockHash | None, bool]] = []
        self.pool = pool
        pool.on_evict = self

    def __call__(self, block: Block, block_hash: BlockHash) -> None:
        # (block id, hash passed, hash the block still holds, still mapped in the pool)
        self.calls.append((block.block_id, block_hash, block.block_hash,
                           self.pool.get_cached_block(block_hash) is block))


def publish(m: KVCacheManager, rid: str, tokens: list[int]) -> list[Block]:
    """Admit a prompt whole (its full blocks get published); returns its table."""
    assert m.allocate_slots(rid, len(tokens), 0, (), hashes(tokens), tokens) is not None
    return list(m._tables[rid])


def test_promoted_blocks_become_device_cache_hits() -> None:
    m = KVCacheManager(8, BS)
    tokens = list(range(17))  # 4 full blocks, and the last token is always computed
    hs = hashes(tokens)
    tier = FakeTier({h: bytes([i]) * 8 for i, h in enumerate(hs)})
    assert m.get_computed_blocks(hs, len(tokens)) == ([], 0)
    assert m.promote(hs, len(tokens), tier.load) == 4
    assert tier.calls == hs
    assert m.stats.promoted_blocks == 4
    hits, num_cached = m.get_computed_blocks(hs, len(tokens))
    assert num_cached == 16 and [b.block_hash for b in hits] == hs
    for i, b in enumerate(hits):
        assert tier.device[b.block_id] == bytes([i]) * 8
        assert b.ref_cnt == 0  # idle cached blocks, waiting for the admission that follows
    # left at the MRU end, head last: the LRU end still hands out the never-used blocks first
    assert list(m.pool._free)[-4:] == [b.block_id for b in reversed(hits)]
    m.check_invariants()
    # the admission that follows takes them as hits
    assert m.allocate_slots("r", len(tokens) - num_cached, num_cached, hits, hs, tokens) is not None
    assert m.block_ids("r")[:4] == [b.block_id for b in hits]
    assert m.pool.stats.cache_hits == 4
    m.check_invariants({"r": (ROOT, tokens)})


def test_last_token_is_never_promoted() -> None:
    m = KVCacheManager(8, BS)
    tokens = list(range(16))  # 4 full blocks, but the 4th holds the last token
    hs = hashes(tokens)
    tier = FakeTier({h: b"x" for h in hs})
    assert m.promote(hs, len(tokens), tier.load) == 3
    assert tier.calls == hs[:3]
    assert m.pool.get_cached_block(hs[3]) is None


def test_promotion_stops_at_first_hash_not_in_any_tier() -> None:
    m = KVCacheManager(8, BS)
    tokens = list(range(21))
    hs = hashes(tokens)  # 5 blocks
    tier = FakeTier({hs[0]: b"0", hs[1]: b"1", hs[3]: b"3", hs[4]: b"4"})  # hs[2] is nowhere
    assert m.promote(hs, len(tokens), tier.load) == 2
    assert tier.calls == hs[:3]  # asked for hs[2], then stopped
    hits, num_cached = m.get_computed_blocks(hs, len(tokens))
    assert [b.block_hash for b in hits] == hs[:2] and num_cached == 8
    for h in hs[2:]:
        assert m.pool.get_cached_block(h) is None
    assert m.pool.num_cached_blocks == 2
    assert m.num_blocks_in_use == 0  # the block taken for hs[2] went back, unpublished
    m.check_invariants()


def test_nothing_to_load() -> None:
    m = KVCacheManager(4, BS)
    tier = FakeTier({})
    hs = hashes(list(range(9)))
    assert m.promote(hs, 9, tier.load) == 0
    assert m.promote([], 9, tier.load) == 0
    assert m.stats.promoted_blocks == 0 and m.pool.num_cached_blocks == 0
    m.check_invariants()


def test_promotion_disabled_without_caching() -> None:
    m = KVCacheManager(4, BS, enable_caching=False)
    tier = FakeTier({})
    hs = hashes(list(range(9)))
    tier.store = {h: b"x" for h in hs}
    assert m.promote(hs, 9, tier.load) == 0
    assert tier.calls == []


def test_device_prefix_is_pinned_while_promoting() -> None:
    """The device-cached head of the prefix sits at the LRU end of the free queue; the
    promotion's own allocations must not take it."""
    m = KVCacheManager(4, BS)
    log = EvictLog(m.pool)
    head = list(range(8))  # blocks h0, h1
    table = publish(m, "a", head)
    assert [b.block_id for b in table] == [0, 1]
    m.free("a")  # free queue: 2, 3, 1, 0
    other = m.pool.get_new_blocks(2)  # ids 2, 3: used and returned, so 1, 0 become the LRU end
    assert other is not None and [b.block_id for b in other] == [2, 3]
    m.pool.free_blocks(reversed(other))
    assert list(m.pool._free) == [1, 0, 3, 2]

    tokens = head + list(range(100, 108)) + [999]  # h0, h1 on the device, h2, h3 below
    hs = hashes(tokens)
    tier = FakeTier({hs[2]: b"2", hs[3]: b"3"})  # the device blocks cannot be reloaded
    assert m.promote(hs, len(tokens), tier.load) == 2
    assert tier.calls == hs[2:]
    hits, num_cached = m.get_computed_blocks(hs, len(tokens))
    assert num_cached == 16
    assert [b.block_id for b in hits[:2]] == [0, 1]  # still where they were
    assert all(b.ref_cnt == 0 for b in m.pool.blocks)
    assert log.calls == []  # no cached block was given up
    m.check_invariants()


def test_ref_counts_of_blocks_in_use_are_restored() -> None:
    m = KVCacheManager(6, BS)
    head = list(range(9))  # 2 full blocks + 1 token: 3 blocks, running
    publish(m, "running", head)
    before = [(b.block_id, b.ref_cnt) for b in m.pool.blocks]
    tokens = head[:8] + list(range(50, 54)) + [7]
    hs = hashes(tokens)
    tier = FakeTier({hs[2]: b"2"})
    assert m.promote(hs, len(tokens), tier.load) == 1
    loaded = m.pool.get_cached_block(hs[2])
    assert loaded is not None and loaded.ref_cnt == 0
    after = [(b.block_id, b.ref_cnt) for b in m.pool.blocks if b is not loaded]
    assert after == [x for x in before if x[0] != loaded.block_id]
    m.check_invariants({"running": (ROOT, head)})
    hits, num_cached = m.get_computed_blocks(hs, len(tokens))
    assert num_cached == 12 and hits[2] is loaded


def test_full_pool_promotes_nothing_and_restores_everything() -> None:
    m = KVCacheManager(2, BS)
    publish(m, "r", list(range(8)))  # both blocks in use
    tokens = list(range(8)) + list(range(20, 24)) + [1]
    hs = hashes(tokens)
    tier = FakeTier({hs[2]: b"2"})
    assert m.promote(hs, len(tokens), tier.load) == 0
    assert tier.calls == []  # no block to load into: load is not even asked
    assert [b.ref_cnt for b in m.pool.blocks] == [1, 1]
    m.check_invariants({"r": (ROOT, list(range(8)))})


def test_promotion_reusing_a_cached_block_demotes_it() -> None:
    m = KVCacheManager(2, BS)
    log = EvictLog(m.pool)
    old = publish(m, "old", list(range(50, 54)) + [0])  # block 0 cached (hash g0), block 1 partial
    g0 = old[0].block_hash
    assert g0 is not None
    m.free("old")  # free queue: 1, 0
    tokens = list(range(8)) + [1]
    hs = hashes(tokens)
    tier = FakeTier({hs[0]: b"0", hs[1]: b"1"})
    assert m.promote(hs, len(tokens), tier.load) == 2
    assert log.calls == [(0, g0, g0, True)]  # told while block 0 still held g0's KV
    assert m.pool.get_cached_block(g0) is None
    m.check_invariants()


# ---- BlockPool.on_evict and hold --------------------------------------------------------------


def test_on_evict_exactly_when_a_cached_block_is_reused() -> None:
    pool = BlockPool(3)
    log = EvictLog(pool)
    hs = hashes(list(range(12)))
    blocks = pool.get_new_blocks(3)
    assert blocks is not None
    pool.cache_block(blocks[0], hs[0])
    pool.cache_block(blocks[1], hs[1])  # block 2 stays unhashed
    pool.free_blocks([blocks[2], blocks[1], blocks[0]])  # free queue: 2, 1, 0
    assert log.calls == []  # freeing keeps the KV: nothing is evicted
    pool.touch([blocks[0]])  # a cache hit: not an eviction either
    pool.free_blocks([blocks[0]])  # free queue: 2, 1, 0
    assert log.calls == []

    (b,) = pool.get_new_blocks(1) or []
    assert b.block_id == 2 and log.calls == []  # no hash: nothing to demote
    (b,) = pool.get_new_blocks(1) or []
    assert b.block_id == 1
    assert log.calls == [(1, hs[1], hs[1], True)]
    assert b.block_hash is None and pool.get_cached_block(hs[1]) is None
    assert pool.stats.evictions == 1
    pool.check_invariants()


def test_on_evict_not_called_when_caches_are_dropped() -> None:
    pool = BlockPool(2)
    log = EvictLog(pool)
    hs = hashes(list(range(8)))
    blocks = pool.get_new_blocks(2)
    assert blocks is not None
    for blk, h in zip(blocks, hs, strict=True):
        pool.cache_block(blk, h)
    pool.free_blocks(reversed(blocks))
    assert pool.evict_all_cached() == 2  # weights changed: the KV is worthless, not demoted
    assert log.calls == []
    assert pool.get_new_blocks(2) is not None and log.calls == []
    pool.check_invariants()


def test_on_evict_default_is_none() -> None:
    pool = BlockPool(1)
    assert pool.on_evict is None
    (b,) = pool.get_new_blocks(1) or []
    pool.cache_block(b, b"h" * 32)
    pool.free_blocks([b])
    assert pool.get_new_blocks(1) is not None  # no hook: evicts silently


def test_hold_pins_without_counting_a_hit() -> None:
    pool = BlockPool(3)
    blocks = pool.get_new_blocks(1)
    assert blocks is not None
    (b,) = blocks
    pool.cache_block(b, b"h" * 32)
    pool.free_blocks([b])
    pool.hold(b)
    assert b.ref_cnt == 1 and pool.num_free_blocks == 2 and b.hits == 0
    assert pool.stats.cache_hits == 0
    pool.hold(b)
    assert b.ref_cnt == 2
    taken = pool.get_new_blocks(2)
    assert taken is not None and b not in taken  # a held block is never handed out
    assert pool.get_new_blocks(1) is None
    pool.free_blocks([b, b])
    assert b.ref_cnt == 0 and pool.get_cached_block(b"h" * 32) is b
    pool.check_invariants()


def test_hold_then_free_restores_lru_position_at_mru_end() -> None:
    pool = BlockPool(3)
    blocks = pool.get_new_blocks(3)
    assert blocks is not None
    pool.free_blocks(blocks)  # 0, 1, 2
    pool.hold(blocks[0])
    pool.free_blocks([blocks[0]])
    assert list(pool._free) == [1, 2, 0]


@pytest.mark.parametrize("num_blocks", [3, 5, 9])
def test_repeated_promotion_is_idempotent(num_blocks: int) -> None:
    m = KVCacheManager(num_blocks, BS)
    tokens = list(range(4 * (num_blocks - 1) + 1))
    hs = hashes(tokens)
    tier = FakeTier({h: b"x" for h in hs})
    first = m.promote(hs, len(tokens), tier.load)
    assert first == num_blocks - 1
    assert m.promote(hs, len(tokens), tier.load) == 0  # all on the device now
    assert len(tier.calls) == first
    m.check_invariants()


def test_a_tier_that_raises_leaks_no_block() -> None:
    m = KVCacheManager(8, BS)
    tokens = list(range(21))
    hs = hashes(tokens)
    good = FakeTier({hs[0]: b"0"})

    def load(block_hash: BlockHash, block_id: int) -> bool:
        if block_hash == hs[1]:
            raise OSError("tier failed")
        return good.load(block_hash, block_id)

    with pytest.raises(OSError):
        m.promote(hs, len(tokens), load)
    assert m.num_blocks_in_use == 0 and m.pool.num_free_blocks == 8
    assert m.pool.get_cached_block(hs[0]) is not None and m.pool.get_cached_block(hs[1]) is None
    m.check_invariants()
