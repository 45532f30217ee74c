"""KVCacheManager: per-request block tables over a BlockPool, with prefix-cache lookup.

The scheduler asks three questions, check-and-act style:
``get_computed_blocks`` (how much of this prompt is cached?), ``allocate_slots`` (room for N more
tokens? → new blocks or None, nothing changed on None) and ``free`` (request done or preempted).

    request r1 block table:  [b4 | b9 | b2 | b6]    tokens 0..63, b6 partly filled
                               ↑ cached hits from an earlier request with the same prefix
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from cache.block_pool import Block, BlockPool
from cache.hashing import BlockHash, extend_block_hashes
from cache.quota import PUBLIC, UNKNOWN


@dataclass(slots=True)
class PrefixCacheStats:
    """What the prefix cache did; counters only grow."""

    lookups: int = 0
    query_tokens: int = 0
    hit_tokens: int = 0
    lookup_time_s: float = 0.0
    duplicate_blocks: int = 0
    promoted_blocks: int = 0


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Maps requests to block tables and publishes their full blocks in the prefix cache."""

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks)
        self.stats = PrefixCacheStats()
        self._tables: dict[str, list[Block]] = {}
        self._num_published: dict[str, int] = {}

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_blocks_in_use(self) -> int:
        """Blocks referenced by at least one live request."""
        return self.pool.num_blocks - self.pool.num_free_blocks

    def blocks(self, request_id: str) -> list[Block]:
        return list(self._tables.get(request_id, ()))

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self._tables.get(request_id, ())]

    def rows(self, request_id: str) -> list[int]:
        """The KV storage rows of a request's blocks, in order: its block table for attention."""
        return [b.slot for b in self._tables.get(request_id, ())]

    def reusable_hashes(self, block_hashes: Sequence[BlockHash], num_tokens: int) -> Sequence[BlockHash]:
        """The hashes of a prompt's blocks that a cache may supply: every full block, except that
        the last token is always computed (the model must produce its logits)."""
        return block_hashes[: min(len(block_hashes), max(0, num_tokens - 1) // self.block_size)]

    def missing_hashes(self, block_hashes: Sequence[BlockHash], num_tokens: int) -> Sequence[BlockHash]:
        """The reusable hashes past the longest prefix already cached on the device."""
        reusable = self.reusable_hashes(block_hashes, num_tokens)
        i = 0
        while i < len(reusable) and self.pool.get_cached_block(reusable[i]) is not None:
            i += 1
        return reusable[i:]

    def get_computed_blocks(self, block_hashes: Sequence[BlockHash], num_tokens: int) -> tuple[list[Block], int]:
        """Longest cached prefix of a request: (hit blocks, number of cached tokens).

        At least the last token is always left to compute: the model must produce its logits.
        """
        if not self.enable_caching:
            return [], 0
        start = time.perf_counter()
        hits: list[Block] = []
        for block_hash in self.reusable_hashes(block_hashes, num_tokens):
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        self.stats.lookup_time_s += time.perf_counter() - start
        return hits, len(hits) * self.block_size

    def promote(self, block_hashes: Sequence[BlockHash], num_tokens: int,
                load: Callable[[BlockHash, int], bool], owner: str = UNKNOWN, public_blocks: int = 0) -> int:
        """Bring the lower-tier continuation of a prompt's cached prefix into the device pool.

        Walks the prefix: blocks already on the device are pinned, the next missing ones are given
        a fresh block and filled by ``load(hash, block_id)`` (False = not in any lower tier: stop).
        Loaded blocks are published and, like every idle cached block, left at the free queue's
        MRU end, so the ``get_computed_blocks`` that follows finds them. Returns how many loaded.
        """
        if not self.enable_caching:
            return 0
        held: list[Block] = []
        loaded = 0
        try:
            for i, block_hash in enumerate(self.reusable_hashes(block_hashes, num_tokens)):
                block = self.pool.get_cached_block(block_hash)
                if block is None:
                    fresh = self.pool.get_new_blocks(1, owner)
                    if fresh is None:
                        break
                    block = fresh[0]
                    try:
                        ok = load(block_hash, block.block_id)
                    except BaseException:
                        self.pool.free_blocks([block])  # a failing tier must not leak the block
                        raise
                    if not ok:
                        self.pool.free_blocks([block])
                        break
                    self.pool.cache_block(block, block_hash, PUBLIC if i < public_blocks else owner,
                                          block_hashes[i - 1] if i else None)
                    loaded += 1
                else:
                    self.pool.hold(block)
                held.append(block)
        finally:
            self.pool.free_blocks(reversed(held))
        self.stats.promoted_blocks += loaded
        return loaded

    def record_prefix_query(self, num_tokens: int, num_cached_tokens: int) -> None:
        """Count one admitted request's lookup (a lookup retried while blocked counts once)."""
        self.stats.lookups += 1
        self.stats.query_tokens += num_tokens
        self.stats.hit_tokens += num_cached_tokens

    def can_allocate(self, request_id: str, num_tokens_total: int, new_computed_blocks: Sequence[Block] = ()) -> bool:
        """Whether ``allocate_slots`` would succeed for a table covering ``num_tokens_total`` tokens."""
        return self._blocks_needed(request_id, num_tokens_total, new_computed_blocks) <= self.pool.num_free_blocks

    def _blocks_needed(self, request_id: str, num_tokens_total: int, new_computed_blocks: Sequence[Block]) -> int:
        have = len(self._tables.get(request_id, ())) + len(new_computed_blocks)
        fresh = max(0, _cdiv(num_tokens_total, self.block_size) - have)
        idle_hits = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        return fresh + idle_hits

    def allocate_slots(
        self,
        request_id: str,
        num_new_tokens: int,
        num_computed_tokens: int,
        new_computed_blocks: Sequence[Block] = (),
        block_hashes: Sequence[BlockHash] = (),
        token_ids: Sequence[int] = (),
        owner: str = UNKNOWN,
        public_blocks: int = 0,
    ) -> list[Block] | None:
        """Grow the request's table to hold ``num_computed_tokens + num_new_tokens`` tokens.

        ``new_computed_blocks`` are this request's cache hits (first allocation only). Full blocks
        covered after this step are published under ``block_hashes``, held by ``owner`` (the
        first ``public_blocks`` by the public namespace). Returns the newly taken blocks, or None
        (with nothing changed) when the pool lacks room.
        """
        total = num_computed_tokens + num_new_tokens
        if self._blocks_needed(request_id, total, new_computed_blocks) > self.pool.num_free_blocks:
            return None
        table = self._tables.setdefault(request_id, [])
        self.pool.touch(new_computed_blocks)
        table.extend(new_computed_blocks)
        fresh = max(0, _cdiv(total, self.block_size) - len(table))
        new_blocks = self.pool.get_new_blocks(fresh, owner)
        assert new_blocks is not None, "free-block check and allocation disagree"
        table.extend(new_blocks)
        if self.enable_caching and block_hashes:
            self._publish(request_id, table, block_hashes, total, owner, public_blocks)
        return new_blocks

    def _publish(
        self, request_id: str, table: list[Block], block_hashes: Sequence[BlockHash], total: int,
        owner: str, public_blocks: int,
    ) -> None:
        num_full = min(total // self.block_size, len(block_hashes))
        done = self._num_published.get(request_id, 0)
        for i in range(done, num_full):
            if not self.pool.cache_block(table[i], block_hashes[i], PUBLIC if i < public_blocks else owner,
                                         block_hashes[i - 1] if i else None):
                self.stats.duplicate_blocks += 1
        self._num_published[request_id] = max(done, num_full)

    def free(self, request_id: str) -> int:
        """Release a finished, aborted or preempted request's blocks, tail first; returns how many."""
        table = self._tables.pop(request_id, None)
        self._num_published.pop(request_id, None)
        if not table:
            return 0
        self.pool.free_blocks(reversed(table))
        return len(table)

    def check_invariants(self, live: Mapping[str, tuple[BlockHash, Sequence[int]]] | None = None) -> None:
        """Assert pool consistency and, given each live request's (root hash, tokens), its table.

        Every block referenced by a table has a ref count equal to the number of tables holding
        it, and with caching on, every published block of a request sits under the hash of that
        request's prefix (so a hash always names a block holding exactly those tokens).
        """
        self.pool.check_invariants()
        refs: dict[int, int] = {}
        for table in self._tables.values():
            for block in table:
                refs[block.block_id] = refs.get(block.block_id, 0) + 1
        for block in self.pool.blocks:
            assert block.ref_cnt == refs.get(block.block_id, 0), (
                f"block {block.block_id}: ref_cnt {block.ref_cnt} != {refs.get(block.block_id, 0)} table refs")
        if live is None:
            return
        for request_id, (root, tokens) in live.items():
            table = self._tables.get(request_id, [])
            expected = extend_block_hashes([], root, tokens, self.block_size)
            for i, block in enumerate(table[: len(expected)]):
                if block.block_hash is not None:
                    assert block.block_hash == expected[i], f"{request_id}: block {i} holds another prefix"

