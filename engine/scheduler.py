"""Scheduler: continuous batching with a per-step token budget, chunked prefill and preemption.

Each step: running sequences first (a decode costs one token, an unfinished prefill a chunk),
then waiting ones while budget, sequence slots and KV blocks last. When a running sequence
cannot get a block, the most recently admitted running sequence is preempted: its blocks are
freed (their cached prefix usually survives in the free queue) and it is recomputed later.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from cache.block_pool import Block
from cache.manager import KVCacheManager
from engine.sequence import Sequence, SequenceStatus


@dataclass(slots=True)
class ScheduledSeq:
    """One sequence's share of a step: compute tokens [start, start + num_new)."""

    seq: Sequence
    start: int
    num_new: int

    @property
    def samples(self) -> bool:
        """Whether this step reaches the sequence's last token, so it samples the next one."""
        return self.start + self.num_new == self.seq.num_tokens


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new for s in self.scheduled)


class Scheduler:
    """Decides which sequences run each step and keeps their block tables allocated."""

    def __init__(self, manager: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        self.manager = manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        # Set by the engine when lower cache tiers exist: loads a waiting sequence's prefix from
        # host memory into the device pool just before its cache lookup.
        self.promote: Callable[[Sequence], int] | None = None
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def __len__(self) -> int:
        return len(self.waiting) + len(self.running)

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        scheduled_ids: set[str] = set()
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if self._allocate(seq, num_new):
                out.scheduled.append(ScheduledSeq(seq, seq.num_computed_tokens, num_new))
                scheduled_ids.add(seq.seq_id)
                budget -= num_new
                i += 1
                continue
            victim = self.running[-1]
            assert victim.seq_id not in scheduled_ids, "preemption victim already scheduled"
            self._preempt(victim)
            out.preempted.append(victim)
        if out.preempted:
            return out
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            hits: list[Block] = []
            num_cached = 0
            if seq.num_computed_tokens == 0:
                if self.promote is not None:
                    self.promote(seq)
                hits, num_cached = self.manager.get_computed_blocks(seq.block_hashes, seq.num_tokens)
            num_new = min(seq.num_tokens - num_cached, budget)
            new = self.manager.allocate_slots(
                seq.seq_id, num_new, num_cached, hits, seq.block_hashes, seq.token_ids)
            if new is None:
                break
            self.waiting.popleft()
            if seq.num_cached_tokens < 0:
                seq.num_cached_tokens = min(num_cached, seq.prompt_len)
                self.manager.record_prefix_query(seq.num_tokens, num_cached)
            seq.num_computed_tokens = num_cached
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append(ScheduledSeq(seq, num_cached, num_new))
            budget -= num_new
        return out

    def _allocate(self, seq: Sequence, num_new: int) -> bool:
        new = self.manager.allocate_slots(
            seq.seq_id, num_new, seq.num_computed_tokens, (), seq.block_hashes, seq.token_ids)
        return new is not None

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.manager.free(seq.seq_id)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def finish(self, seq: Sequence, reason: str) -> None:
        """Mark a sequence finished (or aborted) and free its blocks at once."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        # LOADING: never entered the queues
        self.manager.free(seq.seq_id)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
