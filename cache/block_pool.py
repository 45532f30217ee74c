"""BlockPool: the device's KV blocks as metadata — ref counts, an LRU free queue, the hash map.

A block whose ref count drops to zero keeps its hash and its KV: it waits in the free queue and
is reused by the next request with the same prefix, until allocation needs it and evicts it.

    free queue (LRU → MRU):  [b7] ⇄ [b3] ⇄ [b9]  ← freed blocks join at the tail
                               ↑ get_new_blocks pops here (evicting b7's hash if it had one)
    cached:  {h(b3): b3, h(b9): b9, h(b4): b4}     (b4 is in use, ref_cnt > 0)
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass
from itertools import islice

from cache.events import NO_EVENTS, MediumEvents, NoEvents
from cache.hashing import BlockHash
from cache.quota import UNKNOWN, QuotaLedger
from cache.telemetry import BlockLife


@dataclass(slots=True)
class Block:
    """One fixed-size slot range of the KV pool."""

    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None
    cached_at: float = 0.0
    hits: int = 0
    # the KVStorage row holding its KV; it starts as block_id and changes only while the block is
    # idle, when a host tier sharing the storage trades rows with it (cache.tiers.host)
    slot: int = -1

    def __post_init__(self) -> None:
        if self.slot < 0:
            self.slot = self.block_id


@dataclass(slots=True)
class BlockPoolStats:
    """Counters a metrics layer reads; they only grow."""

    allocations: int = 0
    cached: int = 0  # blocks published under a hash
    evictions: int = 0
    cache_hits: int = 0


class BlockPool:
    """Owns every block, the free queue in LRU order and the hash → block map."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, Block] = OrderedDict((b.block_id, b) for b in self.blocks)
        self._cached: dict[BlockHash, Block] = {}
        self.stats = BlockPoolStats()
        self.life = BlockLife()  # reuse distance and lifetime of cached blocks (gap metric 4)
        self.ledger = QuotaLedger(num_blocks)  # who holds each cached block; tenants' device quotas
        # Called with (block, hash) just before a cached block's KV is given up for reuse, while
        # the block still holds it: the tier chain copies it down (demotion).
        self.on_evict: Callable[[Block, BlockHash], None] | None = None
        self.events: MediumEvents | NoEvents = NO_EVENTS  # KV events of the pool (cache.events)

    @property
    def num_free_blocks(self) -> int:
        """Blocks that an allocation may take (free, possibly still holding cached KV)."""
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def cached_blocks(self) -> list[tuple[BlockHash, Block]]:
        return list(self._cached.items())

    def get_cached_block(self, block_hash: BlockHash) -> Block | None:
        return self._cached.get(block_hash)

    def get_new_blocks(self, num: int, owner: str = UNKNOWN) -> list[Block] | None:
        """Take ``num`` blocks for ``owner``, or None if fewer are free.

        Blocks come from the LRU end of the free queue; once tenants have device quotas, the
        ledger may pick another idle block instead (``cache.quota``: an owner at its quota gives
        up its own first, and nobody is pushed below its fair share).
        """
        if num > len(self._free):
            return None
        taken = []
        for _ in range(num):
            block = self._take(owner)
            self._evict(block)
            block.ref_cnt = 1
            taken.append(block)
        self.stats.allocations += num
        return taken

    _SCAN = 64  # free-queue entries searched for an empty block before evicting a protected one

    def _take(self, owner: str) -> Block:
        head = next(iter(self._free.values()))
        if not self.ledger.active or head.block_hash is None:
            return self._free.pop(head.block_id)
        choice = self.ledger.choose(owner, head.block_hash, self._idle)
        if choice != head.block_hash and not self.ledger.at_quota(owner):
            for block in islice(self._free.values(), self._SCAN):
                if block.block_hash is None:  # an empty block costs nobody anything
                    return self._free.pop(block.block_id)
        block = self._cached[choice] if choice is not None else head  # type: ignore[index]
        return self._free.pop(block.block_id)

    def _idle(self, block_hash: Hashable) -> bool:
        block = self._cached.get(block_hash)  # type: ignore[call-overload]
        return block is not None and block.ref_cnt == 0

    def touch(self, blocks: Iterable[Block]) -> None:
        """Take a reference on cache-hit blocks, pulling idle ones out of the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1
            block.hits += 1
            self.stats.cache_hits += 1
            if block.block_hash is not None:
                self.life.accessed(block.block_hash)
                self.ledger.touch(block.block_hash)

    def hold(self, block: Block) -> None:
        """Take a reference without counting a cache hit (pins a block while a prefix is assembled)."""
        if block.ref_cnt == 0:
            del self._free[block.block_id]
        block.ref_cnt += 1

    def free_blocks(self, blocks: Iterable[Block]) -> None:
        """Drop one reference from each block; blocks reaching zero join the free queue's tail.

        Callers pass a request's blocks tail-first, so a chain's tail is evicted before its head.
        An owner left holding more idle cached blocks than its quota drops the oldest at once.
        """
        over: set[str] = set()
        for block in blocks:
            assert block.ref_cnt > 0, f"double free of block {block.block_id}"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = block
                if block.block_hash is not None:
                    self.ledger.touch(block.block_hash)
                    if self.ledger.active:
                        owner = self.ledger.owner_of(block.block_hash) or UNKNOWN
                        limit = self.ledger.limit(owner)
                        if limit is not None and self.ledger.count(owner) > limit:
                            over.add(owner)
        for owner in over:  # blocks kept past the quota while a request held them
            self._trim(owner, self.ledger.limit(owner) or 0)

    def cache_block(self, block: Block, block_hash: BlockHash, owner: str = UNKNOWN,
                    parent: BlockHash | None = None) -> bool:
        """Publish a full block under its hash for ``owner`` (who computed or loaded it); False if
        another block already holds that prefix. ``parent``: the hash before it in its prompt
        (for the KV events only)."""
        if block.block_hash is not None:
            return block.block_hash == block_hash
        if block_hash in self._cached:
            return False
        block.block_hash = block_hash
        block.cached_at = time.monotonic()
        block.hits = 0
        self._cached[block_hash] = block
        self.stats.cached += 1
        self.life.inserted(block_hash)
        self.events.stored(block_hash, parent)
        self.ledger.add(block_hash, owner)
        limit = self.ledger.limit(owner)
        if limit is not None and self.ledger.count(owner) > limit:
            self._trim(owner, limit)
        return True

    def _trim(self, owner: str, limit: int) -> None:
        """Drop ``owner``'s least recently used idle cached blocks until it holds ``limit``
        (blocks that requests hold stay: a quota never takes KV from a running request)."""
        surplus = self.ledger.count(owner) - limit
        idle = [h for h in self.ledger.oldest(owner) if self._idle(h)][:surplus]
        for block_hash in idle:
            self._evict(self._cached[block_hash])  # type: ignore[index]
            self.ledger.own_evictions += 1

    def _evict(self, block: Block, demote: bool = True) -> None:
        if block.block_hash is None:
            return
        if demote and self.on_evict is not None:
            self.on_evict(block, block.block_hash)
        del self._cached[block.block_hash]
        self.life.removed(block.block_hash)
        self.events.removed(block.block_hash)
        self.ledger.remove(block.block_hash)
        block.block_hash = None
        self.stats.evictions += 1

    def drop(self, block_hash: BlockHash) -> bool | None:
        """Forget an idle cached block's prefix without demoting it (its owner asked for it to be
        gone from every tier); the block stays free. True if dropped, False if a request holds it
        (it stays), None if no block holds ``block_hash``."""
        block = self._cached.get(block_hash)
        if block is None:
            return None
        if block.ref_cnt > 0:
            return False
        self._evict(block, demote=False)
        return True

    def evict_all_cached(self) -> int:
        """Forget every idle cached block's hash (e.g. after weights change); returns how many."""
        idle = [b for b in self._free.values() if b.block_hash is not None]
        for block in idle:
            self._evict(block, demote=False)
        return len(idle)

    def check_invariants(self) -> None:
        """Assert the pool's internal consistency; tests call this after every scenario."""
        for block in self.blocks:
            assert block.ref_cnt >= 0, block
            in_free = block.block_id in self._free
            assert in_free == (block.ref_cnt == 0), f"block {block.block_id} ref={block.ref_cnt} free={in_free}"
            if block.block_hash is not None:
                assert self._cached.get(block.block_hash) is block, f"block {block.block_id} hash unmapped"
        for block_hash, block in self._cached.items():
            assert block.block_hash == block_hash
            assert self.ledger.owner_of(block_hash) is not None, f"block {block.block_id} has no owner"
        assert len(self.ledger) == len(self._cached)
        assert len(self._free) + sum(1 for b in self.blocks if b.ref_cnt > 0) == self.num_blocks
