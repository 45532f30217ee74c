"""BlockPool on a 10-block pool: exact block ids, LRU free-queue order, cache hits and evictions."""

from __future__ import annotations

import pytest

from cache.block_pool import Block, BlockPool
from cache.hashing import hash_block_tokens, root_hash

ROOT = root_hash(b"ns", b"model")


def h(i: int) -> bytes:
    return hash_block_tokens(ROOT, [i])


def ids(blocks: list[Block] | None) -> list[int]:
    assert blocks is not None
    return [b.block_id for b in blocks]


def take(pool: BlockPool, num: int) -> list[Block]:
    blocks = pool.get_new_blocks(num)
    assert blocks is not None
    return blocks


def free_queue(pool: BlockPool) -> list[int]:
    """The free queue's block ids, LRU first (read without disturbing it)."""
    return list(pool._free)


def drain(pool: BlockPool) -> list[int]:
    """Allocate every free block: the order `get_new_blocks` hands them out in."""
    return ids(pool.get_new_blocks(pool.num_free_blocks))


@pytest.fixture
def pool() -> BlockPool:
    return BlockPool(10)


def test_rejects_empty_pool() -> None:
    with pytest.raises(ValueError, match="num_blocks must be positive"):
        BlockPool(0)


def test_new_pool_hands_out_lowest_ids_first(pool: BlockPool) -> None:
    assert pool.num_free_blocks == 10
    blocks = take(pool, 3)
    assert ids(blocks) == [0, 1, 2]
    assert [b.ref_cnt for b in blocks] == [1, 1, 1]
    assert pool.num_free_blocks == 7
    assert free_queue(pool) == [3, 4, 5, 6, 7, 8, 9]
    assert pool.stats.allocations == 3
    pool.check_invariants()


def test_get_zero_blocks_is_empty(pool: BlockPool) -> None:
    assert pool.get_new_blocks(0) == []
    assert pool.num_free_blocks == 10


def test_freed_blocks_join_the_tail_in_the_order_given(pool: BlockPool) -> None:
    blocks = take(pool, 3)
    pool.free_blocks(reversed(blocks))
    assert free_queue(pool) == [3, 4, 5, 6, 7, 8, 9, 2, 1, 0]
    pool.check_invariants()
    assert drain(pool) == [3, 4, 5, 6, 7, 8, 9, 2, 1, 0]


def test_block_with_two_refs_is_free_only_after_both_drop(pool: BlockPool) -> None:
    (b0,) = take(pool, 1)
    pool.cache_block(b0, h(0))
    pool.touch([b0])
    assert b0.ref_cnt == 2
    pool.free_blocks([b0])
    assert b0.ref_cnt == 1
    assert 0 not in free_queue(pool)
    pool.check_invariants()
    pool.free_blocks([b0])
    assert free_queue(pool)[-1] == 0
    pool.check_invariants()


def test_freed_cached_block_is_found_by_hash_and_touch_pulls_it_from_the_queue(pool: BlockPool) -> None:
    b0, b1, b2 = take(pool, 3)
    assert pool.cache_block(b0, h(0)) and pool.cache_block(b1, h(1))
    pool.free_blocks([b2, b1, b0])
    assert pool.num_cached_blocks == 2
    assert pool.get_cached_block(h(0)) is b0
    assert pool.get_cached_block(h(1)) is b1
    assert pool.get_cached_block(h(2)) is None
    assert b0.ref_cnt == 0

    pool.touch([b0])
    assert b0.ref_cnt == 1
    assert b0.hits == 1
    assert pool.stats.cache_hits == 1
    assert free_queue(pool) == [3, 4, 5, 6, 7, 8, 9, 2, 1]
    pool.check_invariants()

    pool.touch([b0])  # a second request on an in-use block: no queue change
    assert b0.ref_cnt == 2
    assert b0.hits == 2
    assert pool.stats.cache_hits == 2
    assert pool.num_free_blocks == 9
    pool.check_invariants()
    assert drain(pool) == [3, 4, 5, 6, 7, 8, 9, 2, 1]
    assert pool.get_cached_block(h(0)) is b0


def test_reallocating_a_cached_block_evicts_its_hash_and_records_lifetime() -> None:
    pool = BlockPool(2)
    (b0,) = take(pool, 1)
    assert pool.cache_block(b0, h(0))
    pool.life._seen[h(0)][0] -= 5.0  # cached five seconds ago
    pool.free_blocks([b0])
    assert free_queue(pool) == [1, 0]

    assert ids(pool.get_new_blocks(1)) == [1]  # unhashed block: no eviction
    assert pool.stats.evictions == 0
    assert pool.get_cached_block(h(0)) is b0

    assert ids(pool.get_new_blocks(1)) == [0]
    assert b0.block_hash is None
    assert pool.get_cached_block(h(0)) is None
    assert pool.num_cached_blocks == 0
    assert pool.stats.evictions == 1
    life = pool.life.snapshot()
    assert life["lifetime_s"]["count"] == 1 and 5.0 <= life["lifetime_s"]["sum"] < 60.0
    assert life["uses"]["count"] == 1 and life["uses"]["sum"] == 0  # never hit
    assert life["tracked_blocks"] == 0
    assert pool.stats.allocations == 3
    pool.check_invariants()


def test_block_life_is_bounded_by_the_cached_blocks_and_counts_reuse() -> None:
    pool = BlockPool(1)
    for i in range(400):
        (b,) = take(pool, 1)
        pool.cache_block(b, h(i))
        pool.free_blocks([b])
        assert len(pool.life) == 1  # one record per cached block, never more
    pool.get_new_blocks(1)
    life = pool.life.snapshot()
    assert pool.stats.evictions == 400 and life["lifetime_s"]["count"] == 400
    assert len(life["lifetime_s"]["counts"]) == len(life["lifetime_s"]["buckets"]) + 1

    pool = BlockPool(4)
    b0, b1 = take(pool, 2)
    pool.cache_block(b0, h(0))
    pool.cache_block(b1, h(1))
    pool.touch([b0])  # one access (h(1) cached) in between: distance 1
    pool.touch([b0])  # immediately again: distance 0
    life = pool.life.snapshot()
    assert life["reuse_distance"]["count"] == 2 and life["reuse_distance"]["sum"] == 1


def test_get_new_blocks_returns_none_and_changes_nothing_when_short(pool: BlockPool) -> None:
    take(pool, 8)
    b = pool.blocks[9]
    pool.free_blocks([pool.blocks[5]])
    pool.cache_block(pool.blocks[5], h(5))
    before = (free_queue(pool), pool.stats.allocations, pool.stats.evictions, b.ref_cnt)
    assert pool.get_new_blocks(4) is None
    assert (free_queue(pool), pool.stats.allocations, pool.stats.evictions, b.ref_cnt) == before
    assert free_queue(pool) == [8, 9, 5]
    assert pool.get_cached_block(h(5)) is pool.blocks[5]
    pool.check_invariants()


def test_double_free_raises(pool: BlockPool) -> None:
    (b0,) = take(pool, 1)
    pool.free_blocks([b0])
    with pytest.raises(AssertionError, match="double free of block 0"):
        pool.free_blocks([b0])


def test_free_of_never_allocated_block_raises(pool: BlockPool) -> None:
    with pytest.raises(AssertionError, match="double free of block 4"):
        pool.free_blocks([pool.blocks[4]])


def test_cache_block_refuses_a_hash_another_block_holds(pool: BlockPool) -> None:
    b0, b1 = take(pool, 2)
    assert pool.cache_block(b0, h(0)) is True
    assert pool.cache_block(b1, h(0)) is False
    assert b1.block_hash is None
    assert pool.get_cached_block(h(0)) is b0
    assert pool.num_cached_blocks == 1
    pool.check_invariants()


def test_cache_block_on_an_already_published_block(pool: BlockPool) -> None:
    (b0,) = take(pool, 1)
    assert pool.cache_block(b0, h(0))
    assert pool.cache_block(b0, h(0)) is True  # idempotent
    assert pool.cache_block(b0, h(1)) is False  # a block names one prefix
    assert b0.block_hash == h(0)
    assert pool.get_cached_block(h(1)) is None
    pool.check_invariants()


def test_cache_block_resets_hits(pool: BlockPool) -> None:
    (b0,) = take(pool, 1)
    pool.cache_block(b0, h(0))
    pool.touch([b0])
    pool.free_blocks([b0, b0])
    pool.get_new_blocks(10)  # evicts h(0) from b0 on the way
    assert b0.block_hash is None
    assert pool.cache_block(b0, h(1))
    assert b0.hits == 0


def test_evict_all_cached_forgets_idle_blocks_only(pool: BlockPool) -> None:
    b0, b1, b2 = take(pool, 3)
    for i, b in enumerate((b0, b1, b2)):
        pool.cache_block(b, h(i))
    pool.free_blocks([b2, b1])
    assert pool.evict_all_cached() == 2
    assert pool.stats.evictions == 2
    assert pool.get_cached_block(h(0)) is b0
    assert pool.get_cached_block(h(1)) is None
    assert pool.get_cached_block(h(2)) is None
    assert free_queue(pool) == [3, 4, 5, 6, 7, 8, 9, 2, 1]
    pool.check_invariants()


def test_check_invariants_catches_a_block_in_use_and_in_the_queue(pool: BlockPool) -> None:
    (b0,) = take(pool, 1)
    pool.check_invariants()
    b0.ref_cnt = 0
    with pytest.raises(AssertionError, match="block 0 ref=0 free=False"):
        pool.check_invariants()


def test_check_invariants_catches_a_free_block_with_refs(pool: BlockPool) -> None:
    pool.blocks[7].ref_cnt = 1
    with pytest.raises(AssertionError, match="block 7 ref=1 free=True"):
        pool.check_invariants()


def test_check_invariants_catches_an_unmapped_hash(pool: BlockPool) -> None:
    (b0,) = take(pool, 1)
    b0.block_hash = h(0)
    with pytest.raises(AssertionError, match="block 0 hash unmapped"):
        pool.check_invariants()


def test_check_invariants_catches_a_map_entry_under_the_wrong_hash(pool: BlockPool) -> None:
    b0, b1 = take(pool, 2)
    pool.cache_block(b0, h(0))
    pool.cache_block(b1, h(1))
    pool.check_invariants()
    pool._cached[h(2)] = b0
    with pytest.raises(AssertionError):
        pool.check_invariants()
