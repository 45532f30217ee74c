"""KVCacheManager with 16-token blocks on tiny pools: exact block tables, hits, check-and-act, frees.

The scheduler's use, step by step: ``get_computed_blocks`` → ``allocate_slots`` (None: nothing
changed) → ``record_prefix_query`` once admitted → ``allocate_slots`` per step → ``free``.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from cache.block_pool import Block
from cache.hashing import BlockHash, extend_block_hashes, root_hash
from cache.manager import KVCacheManager

BS = 16
ROOT = root_hash(b"ns", b"model")
OTHER_ROOT = root_hash(b"ns", b"model", "tenant-b")


def hashes(tokens: list[int], root: BlockHash = ROOT) -> list[BlockHash]:
    return extend_block_hashes([], root, tokens, BS)


def admit(m: KVCacheManager, rid: str, tokens: list[int], root: BlockHash = ROOT) -> tuple[list[Block], int] | None:
    """Scheduler-style admission of a whole prompt: (hits, cached tokens), or None if no room."""
    hs = hashes(tokens, root)
    hits, num_cached = m.get_computed_blocks(hs, len(tokens))
    if m.allocate_slots(rid, len(tokens) - num_cached, num_cached, hits, hs, tokens) is None:
        return None
    return hits, num_cached


def snapshot(m: KVCacheManager) -> tuple[object, ...]:
    pool = m.pool
    return (
        list(pool._free),
        {k: b.block_id for k, b in pool._cached.items()},
        [(b.ref_cnt, b.block_hash, b.hits) for b in pool.blocks],
        {rid: m.block_ids(rid) for rid in m._tables},
        dict(m._num_published),
        (pool.stats.allocations, pool.stats.evictions, pool.stats.cache_hits, m.stats.duplicate_blocks),
    )


def alloc(m: KVCacheManager, rid: str, num_new: int, num_computed: int, hits: Sequence[Block],
          tokens: list[int]) -> list[int]:
    """allocate_slots that must succeed: the new blocks' ids."""
    new = m.allocate_slots(rid, num_new, num_computed, hits, hashes(tokens), tokens)
    assert new is not None
    return [b.block_id for b in new]


def next_block_id(m: KVCacheManager) -> int:
    new = m.pool.get_new_blocks(1)
    assert new is not None
    return new[0].block_id


A = list(range(40))  # 2 full blocks and 8 tokens


@pytest.fixture
def m() -> KVCacheManager:
    return KVCacheManager(num_blocks=10, block_size=BS)


def test_rejects_bad_block_size() -> None:
    with pytest.raises(ValueError, match="block_size must be positive"):
        KVCacheManager(num_blocks=10, block_size=0)


def test_first_prompt_gets_fresh_blocks_and_publishes_full_ones(m: KVCacheManager) -> None:
    hs = hashes(A)
    assert m.get_computed_blocks(hs, len(A)) == ([], 0)
    assert alloc(m, "a", 40, 0, [], A) == [0, 1, 2]
    assert m.block_ids("a") == [0, 1, 2]
    assert m.num_blocks_in_use == 3
    assert m.num_free_blocks == 7
    blocks = m.pool.blocks
    assert (blocks[0].block_hash, blocks[1].block_hash, blocks[2].block_hash) == (hs[0], hs[1], None)
    assert m.pool.num_cached_blocks == 2
    m.check_invariants({"a": (ROOT, A)})


def test_shared_prefix_hits_the_full_blocks(m: KVCacheManager) -> None:
    admit(m, "a", A)
    b_tokens = A[:32] + list(range(100, 108))
    hits, num_cached = m.get_computed_blocks(hashes(b_tokens), len(b_tokens))
    assert [b.block_id for b in hits] == [0, 1]
    assert num_cached == 32
    assert alloc(m, "b", 8, 32, hits, b_tokens) == [3]
    assert m.block_ids("b") == [0, 1, 3]
    assert [m.pool.blocks[i].ref_cnt for i in range(4)] == [2, 2, 1, 1]
    assert m.pool.stats.cache_hits == 2
    assert m.num_blocks_in_use == 4
    m.check_invariants({"a": (ROOT, A), "b": (ROOT, b_tokens)})


def test_partial_prefix_stops_at_first_differing_block(m: KVCacheManager) -> None:
    admit(m, "a", A)
    b_tokens = A[:16] + [999] + A[17:]
    assert [b.block_id for b in m.get_computed_blocks(hashes(b_tokens), 40)[0]] == [0]


def test_no_hit_across_cache_salts(m: KVCacheManager) -> None:
    admit(m, "a", A)
    assert m.get_computed_blocks(hashes(A, OTHER_ROOT), 40) == ([], 0)
    assert admit(m, "b", A, OTHER_ROOT) == ([], 0)
    assert m.block_ids("b") == [3, 4, 5]


def test_fully_cached_prompt_still_computes_its_last_block(m: KVCacheManager) -> None:
    admit(m, "a", A)
    prompt = A[:32]  # both blocks cached; the last must be recomputed for its logits
    hits, num_cached = m.get_computed_blocks(hashes(prompt), 32)
    assert [b.block_id for b in hits] == [0]
    assert num_cached == 16
    assert alloc(m, "c", 16, 16, hits, prompt) == [3]
    assert m.pool.blocks[3].block_hash is None  # block 1 already holds that prefix
    assert m.stats.duplicate_blocks == 1
    m.check_invariants({"a": (ROOT, A), "c": (ROOT, prompt)})


@pytest.mark.parametrize(("num_tokens", "num_hits"), [(1, 0), (16, 0), (17, 1), (32, 1), (33, 2), (40, 2)])
def test_hits_always_leave_a_token_to_compute(m: KVCacheManager, num_tokens: int, num_hits: int) -> None:
    admit(m, "a", list(range(48)))
    tokens = list(range(num_tokens))
    hits, num_cached = m.get_computed_blocks(hashes(tokens), num_tokens)
    assert len(hits) == num_hits
    assert num_cached == num_hits * BS < num_tokens


@pytest.mark.parametrize("num_tokens", [1, 16, 17, 32, 33, 48])
def test_cached_tokens_never_reach_num_tokens(m: KVCacheManager, num_tokens: int) -> None:
    # Also when num_tokens is smaller than the hashes cover: never more cached than asked.
    admit(m, "a", list(range(48)))
    hits, num_cached = m.get_computed_blocks(hashes(list(range(48))), num_tokens)
    assert num_cached == len(hits) * BS
    assert num_cached <= num_tokens - 1


def test_zero_tokens_get_no_hits(m: KVCacheManager) -> None:
    # (0 - 1) // BS == -1 must not turn into the slice block_hashes[:-1].
    admit(m, "a", list(range(48)))
    assert m.get_computed_blocks(hashes(list(range(48))), 0) == ([], 0)


def test_caching_disabled_neither_hits_nor_publishes() -> None:
    m = KVCacheManager(num_blocks=10, block_size=BS, enable_caching=False)
    admit(m, "a", A)
    assert m.pool.num_cached_blocks == 0
    assert admit(m, "b", A) == ([], 0)
    assert m.block_ids("b") == [3, 4, 5]
    m.check_invariants({"a": (ROOT, A), "b": (ROOT, A)})


def test_allocate_returns_none_and_changes_nothing_when_short() -> None:
    m = KVCacheManager(num_blocks=4, block_size=BS)
    admit(m, "a", A)
    before = snapshot(m)
    other = list(range(100, 140))
    assert not m.can_allocate("b", 40)
    assert admit(m, "b", other) is None
    assert snapshot(m) == before
    assert m.block_ids("b") == []
    assert m.free("b") == 0
    m.check_invariants({"a": (ROOT, A)})


def test_idle_hits_count_against_free_space() -> None:
    # a: [0 1 2] all full and published; c holds 3; a frees → queue [2 1 0], all idle and hashed.
    m = KVCacheManager(num_blocks=4, block_size=BS)
    prompt_a = list(range(48))
    admit(m, "a", prompt_a)
    admit(m, "c", [500])
    assert m.block_ids("c") == [3]
    m.free("a")
    assert list(m.pool._free) == [2, 1, 0]

    # b hits idle blocks 0, 1 and needs 2 fresh: 4 blocks from a queue of 3.
    b_tokens = prompt_a[:32] + list(range(200, 217))
    hits, num_cached = m.get_computed_blocks(hashes(b_tokens), len(b_tokens))
    assert [b.block_id for b in hits] == [0, 1]
    assert num_cached == 32
    before = snapshot(m)
    assert not m.can_allocate("b", len(b_tokens), hits)
    assert m.allocate_slots("b", 17, 32, hits, hashes(b_tokens), b_tokens) is None
    assert snapshot(m) == before
    assert [blk.ref_cnt for blk in hits] == [0, 0]

    # 33 tokens: the two idle hits plus one fresh block fit exactly; the fresh one evicts block 2.
    d_tokens = prompt_a[:32] + [300]
    hits, num_cached = m.get_computed_blocks(hashes(d_tokens), 33)
    assert m.can_allocate("d", 33, hits)
    assert alloc(m, "d", 1, num_cached, hits, d_tokens) == [2]
    assert m.block_ids("d") == [0, 1, 2]
    assert m.num_free_blocks == 0
    assert m.pool.stats.evictions == 1
    assert m.pool.get_cached_block(hashes(prompt_a)[2]) is None
    m.check_invariants({"c": (ROOT, [500]), "d": (ROOT, d_tokens)})


def test_free_releases_tail_first(m: KVCacheManager) -> None:
    admit(m, "a", A)
    assert m.free("a") == 3
    assert m.num_free_blocks == 10
    assert m.free("a") == 0
    assert [next_block_id(m) for _ in range(10)] == [3, 4, 5, 6, 7, 8, 9, 2, 1, 0]


def test_chain_head_outlives_its_tail_under_eviction() -> None:
    m = KVCacheManager(num_blocks=3, block_size=BS)
    admit(m, "a", A)
    m.free("a")
    assert admit(m, "x", [7]) == ([], 0)
    assert m.block_ids("x") == [2]  # the partial tail goes first
    assert admit(m, "y", [8]) == ([], 0)
    assert m.block_ids("y") == [1]  # then block 1, evicting its hash
    assert m.pool.stats.evictions == 1
    hits, num_cached = m.get_computed_blocks(hashes(A), 40)
    assert [b.block_id for b in hits] == [0]
    assert num_cached == 16


def test_lookup_stops_at_a_hole_in_the_chain(m: KVCacheManager) -> None:
    # d re-enters a's 2 cached blocks: hit 0, a duplicate of 1 (unpublished), then publishes its
    # block 2. Evicting a's block 1 leaves h0 and h2 cached with h1 gone: the lookup must stop.
    a_tokens = list(range(32))
    admit(m, "a", a_tokens)
    assert admit(m, "d", a_tokens) is not None
    d_tokens = a_tokens + list(range(100, 117))
    assert alloc(m, "d", 17, 32, (), d_tokens) == [3, 4]
    assert m.block_ids("d") == [0, 2, 3, 4]
    h0, h1, h2 = hashes(d_tokens)
    assert (m.pool.blocks[2].block_hash, m.pool.blocks[3].block_hash) == (None, h2)
    m.free("a")
    assert admit(m, "x", list(range(500, 596))) == ([], 0)
    assert m.block_ids("x") == [5, 6, 7, 8, 9, 1]
    assert m.pool.get_cached_block(h1) is None
    assert m.pool.get_cached_block(h2) is m.pool.blocks[3]
    hits, num_cached = m.get_computed_blocks(hashes(d_tokens + [7]), 50)
    assert [b.block_id for b in hits] == [0]
    assert num_cached == 16
    m.check_invariants({"d": (ROOT, d_tokens), "x": (ROOT, list(range(500, 596)))})


def test_preempted_request_hits_its_own_blocks_on_readmission(m: KVCacheManager) -> None:
    admit(m, "a", A)
    m.free("a")
    readmitted = admit(m, "a", A)
    assert readmitted is not None and readmitted[1] == 32
    assert m.block_ids("a") == [0, 1, 3]  # idle hits come back; the tail is fresh from the LRU end
    assert list(m.pool._free) == [4, 5, 6, 7, 8, 9, 2]
    m.check_invariants({"a": (ROOT, A)})


def test_chunked_prefill_and_decode_publish_blocks_as_they_fill(m: KVCacheManager) -> None:
    tokens = list(range(20))
    hs = hashes(tokens)
    assert alloc(m, "a", 10, 0, [], tokens) == [0]
    assert m.pool.blocks[0].block_hash is None  # only 10 of 16 tokens covered yet
    assert alloc(m, "a", 10, 10, [], tokens) == [1]
    assert m.pool.blocks[0].block_hash == hs[0]
    for token in range(100, 112):  # decode to 32 tokens, one at a time
        tokens.append(token)
        extend_block_hashes(hs, ROOT, tokens, BS)
        assert m.allocate_slots("a", 1, len(tokens) - 1, [], hs, tokens) == []
        m.check_invariants({"a": (ROOT, tokens)})
    assert m.block_ids("a") == [0, 1]
    assert m.pool.blocks[1].block_hash == hs[1]
    tokens.append(112)
    assert alloc(m, "a", 1, 32, [], tokens) == [2]


def test_record_prefix_query_counts(m: KVCacheManager) -> None:
    m.record_prefix_query(40, 0)
    m.record_prefix_query(40, 32)
    m.record_prefix_query(17, 16)
    assert (m.stats.lookups, m.stats.query_tokens, m.stats.hit_tokens) == (3, 97, 48)


def test_get_computed_blocks_does_not_count_a_query(m: KVCacheManager) -> None:
    admit(m, "a", A)
    m.get_computed_blocks(hashes(A), 40)
    m.get_computed_blocks(hashes(A), 40)  # a blocked request retrying: still no query counted
    assert (m.stats.lookups, m.stats.query_tokens, m.stats.hit_tokens) == (0, 0, 0)


def test_check_invariants_catches_a_ref_count_off_by_one(m: KVCacheManager) -> None:
    admit(m, "a", A)
    m.check_invariants({"a": (ROOT, A)})
    m.pool.blocks[1].ref_cnt += 1
    with pytest.raises(AssertionError, match="block 1: ref_cnt 2 != 1 table refs"):
        m.check_invariants()


def test_check_invariants_catches_a_block_published_under_another_prefix(m: KVCacheManager) -> None:
    admit(m, "a", A)
    b0, b1 = m.pool.blocks[0], m.pool.blocks[1]
    h0, h1 = b0.block_hash, b1.block_hash
    assert h0 is not None and h1 is not None
    b0.block_hash, b1.block_hash = h1, h0  # consistent pool, wrong positions
    m.pool._cached[h0], m.pool._cached[h1] = b1, b0
    m.check_invariants()
    with pytest.raises(AssertionError, match="a: block 0 holds another prefix"):
        m.check_invariants({"a": (ROOT, A)})


def test_check_invariants_catches_the_wrong_tokens_or_root(m: KVCacheManager) -> None:
    admit(m, "a", A)
    with pytest.raises(AssertionError, match="a: block 0 holds another prefix"):
        m.check_invariants({"a": (OTHER_ROOT, A)})
    with pytest.raises(AssertionError, match="a: block 1 holds another prefix"):
        m.check_invariants({"a": (ROOT, A[:20] + [0] * 20)})
