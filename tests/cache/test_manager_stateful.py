"""KVCacheManager against a model of the scheduler: random admits, chunks, decodes, frees, preemptions.

Tokens come from {0, 1} with 2- or 4-token blocks, so prefixes collide all the time; two cache
salts share the pool. Besides the ref counts and the block tables, the model keeps a shadow of
what each slot's KV was computed from, ``(root, token prefix)``, so a hit is checked against the
KV it would have had to recompute, not just against its hash.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from cache.hashing import BlockHash, extend_block_hashes, root_hash
from cache.manager import KVCacheManager

ROOTS = (root_hash(b"ns", b"model", None), root_hash(b"ns", b"model", "tenant-b"))
Slot = tuple[BlockHash, tuple[int, ...]]  # what one slot's KV was computed from


@dataclass
class Req:
    root: BlockHash
    tokens: list[int]
    hashes: list[BlockHash] = field(default_factory=list)
    num_computed: int = 0


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class ManagerMachine(RuleBasedStateMachine):
    @initialize(num_blocks=st.integers(3, 12), block_size=st.sampled_from([2, 4]),
                caching=st.sampled_from([True, True, True, False]))
    def setup(self, num_blocks: int, block_size: int, caching: bool) -> None:
        self.m = KVCacheManager(num_blocks, block_size, enable_caching=caching)
        self.bs = block_size
        self.waiting: dict[str, Req] = {}
        self.running: dict[str, Req] = {}
        self.kv: dict[int, list[Slot | None]] = {i: [None] * block_size for i in range(num_blocks)}
        self.origin: dict[BlockHash, Slot] = {}
        self.queries = (0, 0, 0)
        self.hit_blocks = 0
        self.next_id = 0

    # -- helpers -------------------------------------------------------------------------------

    def free_queue(self) -> list[int]:
        return list(self.m.pool._free)

    def snapshot(self) -> tuple[object, ...]:
        pool = self.m.pool
        return (self.free_queue(), [(b.ref_cnt, b.block_hash) for b in pool.blocks],
                {rid: self.m.block_ids(rid) for rid in (*self.waiting, *self.running)},
                pool.stats.allocations, pool.stats.evictions, pool.stats.cache_hits)

    def rehash(self, req: Req) -> None:
        extend_block_hashes(req.hashes, req.root, req.tokens, self.bs)
        for i, h in enumerate(req.hashes):
            prefix = (req.root, tuple(req.tokens[: (i + 1) * self.bs]))
            assert self.origin.setdefault(h, prefix) == prefix, "two prefixes share a hash"

    def expected_slot(self, req: Req, pos: int) -> Slot:
        return req.root, tuple(req.tokens[: pos + 1])

    def compute(self, rid: str, req: Req, num_new: int) -> None:
        """Run the step: write the KV of positions [num_computed, +num_new) into the table."""
        table = self.m.block_ids(rid)
        assert len(table) == cdiv(req.num_computed + num_new, self.bs)
        for pos in range(req.num_computed, req.num_computed + num_new):
            block_id = table[pos // self.bs]
            assert self.m.pool.blocks[block_id].ref_cnt == 1, f"write into shared block {block_id}"
            self.kv[block_id][pos % self.bs] = self.expected_slot(req, pos)
        req.num_computed += num_new

    def release(self, rid: str, req: Req) -> None:
        table = self.m.block_ids(rid)
        refs = {b: self.m.pool.blocks[b].ref_cnt for b in table}
        queue = self.free_queue()
        assert self.m.free(rid) == len(table)
        assert self.free_queue() == queue + [b for b in reversed(table) if refs[b] == 1]
        req.num_computed = 0

    # -- rules ---------------------------------------------------------------------------------

    @rule(salt=st.sampled_from([0, 1]), prompt=st.lists(st.integers(0, 1), min_size=1, max_size=14))
    def new_request(self, salt: int, prompt: list[int]) -> None:
        req = Req(ROOTS[salt], prompt)
        self.rehash(req)
        self.waiting[f"r{self.next_id}"] = req
        self.next_id += 1

    @precondition(lambda self: self.waiting)
    @rule(data=st.data())
    def admit(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.waiting)))
        req = self.waiting[rid]
        n = len(req.tokens)
        hits, num_cached = self.m.get_computed_blocks(req.hashes, n)
        assert num_cached == len(hits) * self.bs <= n - 1
        if not self.m.enable_caching:
            assert hits == []
        for i, block in enumerate(hits):
            assert block.block_hash == req.hashes[i]
            assert self.origin[req.hashes[i]] == self.expected_slot(req, (i + 1) * self.bs - 1)
            assert self.kv[block.block_id] == [self.expected_slot(req, i * self.bs + s) for s in range(self.bs)]
        limit = min(len(req.hashes), (n - 1) // self.bs)
        if self.m.enable_caching and len(hits) < limit:
            assert self.m.pool.get_cached_block(req.hashes[len(hits)]) is None, "hit prefix not longest"

        num_new = data.draw(st.integers(1, n - num_cached))
        fits = self.m.can_allocate(rid, num_cached + num_new, hits)
        before, queue = self.snapshot(), self.free_queue()
        new = self.m.allocate_slots(rid, num_new, num_cached, hits, req.hashes, req.tokens)
        assert (new is not None) == fits
        if new is None:
            assert self.snapshot() == before
            return
        hit_ids = {b.block_id for b in hits}
        assert [b.block_id for b in new] == [b for b in queue if b not in hit_ids][: len(new)]
        assert self.m.block_ids(rid)[: len(hits)] == [b.block_id for b in hits]
        self.m.record_prefix_query(n, num_cached)
        lookups, query, hit = self.queries
        self.queries = (lookups + 1, query + n, hit + num_cached)
        self.hit_blocks += len(hits)
        del self.waiting[rid]
        self.running[rid] = req
        req.num_computed = num_cached
        self.compute(rid, req, num_new)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def step(self, data: st.DataObject) -> None:
        """A prefill chunk if the request is behind, else sample one token and decode it."""
        rid = data.draw(st.sampled_from(sorted(self.running)))
        req = self.running[rid]
        if req.num_computed < len(req.tokens):
            num_new = data.draw(st.integers(1, len(req.tokens) - req.num_computed))
        else:
            req.tokens.append(data.draw(st.integers(0, 1)))
            self.rehash(req)
            num_new = 1
        fits = self.m.can_allocate(rid, req.num_computed + num_new)
        before, queue = self.snapshot(), self.free_queue()
        new = self.m.allocate_slots(rid, num_new, req.num_computed, (), req.hashes, req.tokens)
        assert (new is not None) == fits
        if new is None:
            assert self.snapshot() == before
            return
        assert [b.block_id for b in new] == queue[: len(new)]
        self.compute(rid, req, num_new)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.running)))
        self.release(rid, self.running.pop(rid))

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def preempt(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.running)))
        req = self.running.pop(rid)
        self.release(rid, req)
        self.waiting[rid] = req

    # -- invariants ----------------------------------------------------------------------------

    @invariant()
    def tables_refs_and_cached_kv_agree(self) -> None:
        m = self.m
        m.check_invariants({rid: (r.root, r.tokens) for rid, r in self.running.items()})
        tables = {rid: m.block_ids(rid) for rid in self.running}
        for rid, req in self.running.items():
            assert len(tables[rid]) == cdiv(req.num_computed, self.bs)
        assert all(m.block_ids(rid) == [] for rid in self.waiting)
        holders = Counter(b for table in tables.values() for b in set(table))
        assert all(len(set(table)) == len(table) for table in tables.values())
        assert m.num_blocks_in_use == len(holders)
        for block in m.pool.blocks:
            assert block.ref_cnt == holders[block.block_id]
            if block.block_hash is not None:
                root, prefix = self.origin[block.block_hash]
                want = [(root, prefix[: len(prefix) - self.bs + s + 1]) for s in range(self.bs)]
                assert self.kv[block.block_id] == want, f"block {block.block_id} KV is not its prefix's"
        if not m.enable_caching:
            assert m.pool.num_cached_blocks == 0
        assert (m.stats.lookups, m.stats.query_tokens, m.stats.hit_tokens) == self.queries
        assert m.pool.stats.cache_hits == self.hit_blocks

    def teardown(self) -> None:
        if not hasattr(self, "m"):
            return
        for rid in sorted(self.running):
            self.release(rid, self.running.pop(rid))
        assert self.m.num_free_blocks == self.m.pool.num_blocks
        assert self.m.num_blocks_in_use == 0
        self.m.check_invariants()


TestManagerMachine = ManagerMachine.TestCase
TestManagerMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
