"""Scheduler: continuous batching with a per-step token budget, chunked prefill, preemption, and
fair sharing between tenants.

Each step: running sequences first (a decode costs one token, an unfinished prefill a chunk),
then waiting ones while budget, sequence slots and KV blocks last. When a running sequence
cannot get a block, another running sequence is preempted: its blocks are freed (their cached
prefix usually survives in the free queue) and it is recomputed later.

Tenants (``Sequence.tenant``, "" for anonymous callers) share the engine by four rules, so that
one tenant's backlog delays another's request by a bounded number of steps:

* Waiting order is round-robin over tenants, one sequence per turn, FIFO within a tenant; a
  preempted sequence goes back to the front of its own tenant's queue. Round-robin by sequence
  rather than deficit round-robin by tokens: what a flooding tenant monopolises is residency —
  slots and KV blocks held for a sequence's whole life — and that cost is unknown at admission
  (max_tokens, stop strings, EOS). A token deficit charged at admission would meter the prompt,
  the cheap part. Residency is balanced directly instead, by the next rule.
* Fair share: with W tenants having work (running or waiting), each is entitled to
  ``max_num_seqs / W`` slots and ``num_blocks / W`` blocks. Before a step schedules anything, a
  tenant under its share whose next waiting sequence would not fit (no slot, or too few blocks)
  takes room from the tenant using the most: that tenant's most recently admitted sequence is
  preempted, provided the tenant is over its share and still holds strictly more than the needy
  one afterwards. The strict inequality rules out ping-pong (the reverse move right after would
  need the opposite inequality); a tenant never preempts itself; a tenant that lost a sequence
  this way admits nothing more in that step. The next sequence of each tenant under its slot
  share, and any sequence room was made for, is admitted before the round-robin turns, so free
  or freed room goes to the tenants short of their share. This happens before scheduling
  because a sequence scheduled in a step has already published the blocks it is about to fill:
  taking it back would leave wrong KV in the cache.
* Block pressure while running: sequences are scheduled lightest tenant first (fewest running),
  so when blocks run out the heavy tenant's sequences are still unscheduled; the victim is the
  most recently admitted unscheduled sequence of the tenant holding the most blocks.
* Newcomers first: when a tenant with nothing running has a sequence waiting while others are
  running, that step admits only such idle tenants' sequences (their prefill runs alone, not
  batched with the busy tenants' decodes and prefills); the next step schedules everyone. A
  request from an idle tenant so waits for at most the step in progress plus its own prefill,
  and the busy tenants lose at most every other step (never two in a row).

With a single tenant all four reduce to the plain FIFO queue and newest-first preemption.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from cache.block_pool import Block
from cache.manager import KVCacheManager
from engine.sequence import Sequence, SequenceStatus
from engine.tenant_queues import TenantQueues

PREEMPTION_REASONS = ("blocks", "fairness")


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
        self.waiting = TenantQueues()
        self.running: list[Sequence] = []
        # Operators' view of why sequences were recomputed, and whose (counters only grow).
        self.num_preemptions = 0
        self.preemptions_by_reason: dict[str, int] = dict.fromkeys(PREEMPTION_REASONS, 0)
        self.preemptions_by_tenant: dict[str, int] = {}
        self._newcomer_step = False  # the previous step ran only newly arrived tenants' prefills

    def __len__(self) -> int:
        return len(self.waiting) + len(self.running)

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        favoured, barred = self._rebalance(out)
        budget = self.max_num_batched_tokens
        scheduled_ids: set[str] = set()
        short_of_blocks = False
        busy = {s.tenant for s in self.running}
        newcomers = not self._newcomer_step and bool(busy) and any(
            t not in busy and t not in barred for t in self.waiting.tenants())
        self._newcomer_step = newcomers
        if newcomers:  # an idle tenant's prefill runs alone this step; the others go on next step
            barred = barred | busy
            favoured = [seq for seq in favoured if seq.tenant not in busy]
        for seq in () if newcomers else self._running_order():
            if budget <= 0:
                break
            if seq.status is not SequenceStatus.RUNNING:  # preempted above to make room
                continue
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            while not self._allocate(seq, num_new):
                victim = self._block_victim(scheduled_ids)
                assert victim.seq_id not in scheduled_ids, "preemption victim already scheduled"
                self._preempt(victim, "blocks")
                out.preempted.append(victim)
                short_of_blocks = True
                if victim is seq:
                    break
            else:
                out.scheduled.append(ScheduledSeq(seq, seq.num_computed_tokens, num_new))
                scheduled_ids.add(seq.seq_id)
                budget -= num_new
        if short_of_blocks:
            return out
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            if favoured:
                seq = favoured.pop(0)
                assert self.waiting.head(seq.tenant) is seq, "room was made for a sequence not first in line"
            else:
                next_seq = self.waiting.next(barred)
                if next_seq is None:
                    break
                seq = next_seq
            hits: list[Block] = []
            num_cached = 0
            if seq.num_computed_tokens == 0:
                if self.promote is not None:
                    self.promote(seq)
                hits, num_cached = self.manager.get_computed_blocks(seq.block_hashes, seq.num_tokens)
            num_new = min(seq.num_tokens - num_cached, budget)
            new = self.manager.allocate_slots(
                seq.seq_id, num_new, num_cached, hits, seq.block_hashes, seq.token_ids,
                seq.tenant, seq.public_blocks)
            if new is None:
                break
            self.waiting.pop_head(seq.tenant)
            if seq.num_cached_tokens < 0:
                seq.num_cached_tokens = min(num_cached, seq.prompt_len)
                self.manager.record_prefix_query(seq.num_tokens, num_cached)
            seq.num_computed_tokens = num_cached
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append(ScheduledSeq(seq, num_cached, num_new))
            budget -= num_new
        return out

    # ---- fairness ---------------------------------------------------------------------------
    def tenants_with_work(self) -> set[str]:
        return set(self.waiting.tenants()) | {s.tenant for s in self.running}

    def _running_order(self) -> list[Sequence]:
        """Running sequences, tenants with the fewest first, admission order within a tenant.

        Later sequences are the ones still unscheduled when blocks run out, so this keeps the
        heavy tenants' sequences available as victims instead of a light tenant's newest one.
        """
        groups: dict[str, list[Sequence]] = {}
        for seq in self.running:
            groups.setdefault(seq.tenant, []).append(seq)
        if len(groups) <= 1:
            return list(self.running)
        return [seq for group in sorted(groups.values(), key=len) for seq in group]

    def _held_blocks(self) -> dict[str, dict[int, int]]:
        """Per tenant: each block its running sequences hold → how many of them hold it."""
        held: dict[str, dict[int, int]] = {}
        for seq in self.running:
            counts = held.setdefault(seq.tenant, {})
            for block_id in self.manager.block_ids(seq.seq_id):
                counts[block_id] = counts.get(block_id, 0) + 1
        return held

    def _block_victim(self, scheduled_ids: set[str]) -> Sequence:
        """The sequence to preempt when a running one needs a block: among those not scheduled
        yet, the newest of the tenant holding the most blocks (ties: the newest overall)."""
        candidates = [s for s in self.running if s.seq_id not in scheduled_ids]
        last = {s.tenant: i for i, s in enumerate(candidates)}
        if len(last) > 1:
            held = self._held_blocks()
            heaviest = max(last, key=lambda t: (len(held.get(t, ())), last[t]))
            return candidates[last[heaviest]]
        return candidates[-1]

    def _rebalance(self, out: SchedulerOutput) -> tuple[list[Sequence], set[str]]:
        """Preempt for tenants under their share whose next sequence would not fit this step.

        Returns the sequences to admit first — the next one of each tenant under its slot share,
        and any room was made for — and the tenants that lost a sequence (they admit nothing more
        this step). One sequence per needy tenant per step: a tenant with a longer backlog climbs
        to its share over as many steps.
        """
        favoured: list[Sequence] = []
        barred: set[str] = set()
        if not self.waiting:
            return favoured, barred
        num_tenants = len(self.tenants_with_work())
        if num_tenants < 2:
            return favoured, barred
        reserved_blocks = reserved_tokens = 0
        running = {t: 0 for t in self.waiting.tenants()}
        for seq in self.running:
            running[seq.tenant] = running.get(seq.tenant, 0) + 1
        running_blocks, running_budget = self._running_demand()
        for tenant in self.waiting.tenants():
            if tenant in barred:
                continue
            seq = self.waiting.head(tenant)
            # Under its slot share: goes first even when it fits, or a tenant at its share whose
            # turn comes earlier would take the free slot and force a preemption next step.
            favour = running[tenant] * num_tenants < self.max_num_seqs
            while True:
                budget = running_budget - reserved_tokens
                if budget <= 0:  # the running sequences take the whole budget: no room to make
                    return favoured, barred
                need, chunk = self._admission_demand(seq, budget)
                no_slot = len(self.running) + len(favoured) >= self.max_num_seqs
                no_blocks = running_blocks + reserved_blocks + need > self.manager.num_free_blocks
                if not (no_slot or no_blocks):
                    if favour:
                        favoured.append(seq)
                        reserved_blocks += need
                        reserved_tokens += chunk
                    break
                spared = {s.tenant for s in favoured}  # judged short of its share this step
                victim = self._fairness_victim(tenant, num_tenants, no_slot, spared)
                if victim is None:
                    break
                self._preempt(victim, "fairness")
                out.preempted.append(victim)
                barred.add(victim.tenant)
                favour = True
                running_blocks, running_budget = self._running_demand()
        return favoured, barred

    def _running_demand(self) -> tuple[int, int]:
        """(new blocks, token budget left) if the running sequences were scheduled now."""
        blocks = 0
        budget = self.max_num_batched_tokens
        size = self.manager.block_size
        for seq in self._running_order():
            if budget <= 0:
                break
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            have = len(self.manager.block_ids(seq.seq_id))
            blocks += max(0, -(-(seq.num_computed_tokens + num_new) // size) - have)
            budget -= num_new
        return blocks, budget

    def _admission_demand(self, seq: Sequence, budget: int) -> tuple[int, int]:
        """(blocks, tokens) admitting a waiting sequence would take now, from its device cache
        hits (promotion from lower tiers can only lower this, so the estimate errs on the safe side)."""
        hits, num_cached = self.manager.get_computed_blocks(seq.block_hashes, seq.num_tokens)
        chunk = min(seq.num_tokens - num_cached, budget)
        fresh = max(0, -(-(num_cached + chunk) // self.manager.block_size) - len(hits))
        return fresh + sum(1 for b in hits if b.ref_cnt == 0), chunk

    def _fairness_victim(self, tenant: str, num_tenants: int, by_slots: bool,
                         spared: set[str]) -> Sequence | None:
        """The newest sequence of the heaviest tenant that may give room to ``tenant``, or None.

        Usage is running sequences (``by_slots``) or distinct blocks held. ``tenant`` must be
        under its share, the victim's tenant over it and, after the preemption, still strictly
        above ``tenant``'s usage. Tenants in ``spared`` (already being admitted first) are not
        taken from: their next sequence must stay first in line.
        """
        newest: dict[str, int] = {}
        for i, seq in enumerate(self.running):
            newest[seq.tenant] = i
        if by_slots:
            capacity = self.max_num_seqs
            usage = {t: 0 for t in newest}
            for seq in self.running:
                usage[seq.tenant] += 1
        else:
            capacity = self.manager.pool.num_blocks
            held = self._held_blocks()
            usage = {t: len(counts) for t, counts in held.items()}
        mine = usage.get(tenant, 0)
        if mine * num_tenants >= capacity:
            return None
        best: tuple[int, int] | None = None
        for other, used in usage.items():
            if other == tenant or other in spared or used * num_tenants <= capacity:
                continue
            victim = self.running[newest[other]]
            if by_slots:
                freed = 1
            else:
                counts = held[other]
                freed = sum(1 for b in self.manager.block_ids(victim.seq_id) if counts[b] == 1)
            if freed == 0 or used - freed <= mine:
                continue
            rank = (used, newest[other])
            if best is None or rank > best:
                best = rank
        return None if best is None else self.running[best[1]]

    def tenant_stats(self) -> dict[str, dict[str, int]]:
        """Per tenant with work or past preemptions: running and waiting sequences, distinct
        blocks held, and how many of its sequences were preempted so far."""
        held = self._held_blocks()
        names = self.tenants_with_work() | set(self.preemptions_by_tenant)
        running = {t: 0 for t in names}
        for seq in self.running:
            running[seq.tenant] += 1
        return {
            t: {"running": running[t], "waiting": self.waiting.count(t), "blocks": len(held.get(t, ())),
                "preemptions": self.preemptions_by_tenant.get(t, 0)}
            for t in sorted(names)
        }

    # ---- bookkeeping ------------------------------------------------------------------------
    def _allocate(self, seq: Sequence, num_new: int) -> bool:
        new = self.manager.allocate_slots(
            seq.seq_id, num_new, seq.num_computed_tokens, (), seq.block_hashes, seq.token_ids,
            seq.tenant, seq.public_blocks)
        return new is not None

    def _preempt(self, seq: Sequence, reason: str) -> None:
        self.running.remove(seq)
        self.manager.free(seq.seq_id)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
        self.preemptions_by_reason[reason] += 1
        self.preemptions_by_tenant[seq.tenant] = self.preemptions_by_tenant.get(seq.tenant, 0) + 1

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
