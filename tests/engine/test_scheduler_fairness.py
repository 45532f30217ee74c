"""Scheduler fairness across tenants, over a real KVCacheManager: counts of steps, never time.

A flood from one tenant must delay another's request by a bounded number of steps; admissions
alternate between tenants; preemption takes from the tenant using the most; one tenant alone
gets exactly the old FIFO queue and newest-first preemption (checked against a model of it).
"""

from __future__ import annotations

from collections import deque

from hypothesis import given, settings
from hypothesis import strategies as st

from cache.block_pool import Block
from cache.hashing import root_hash
from cache.manager import KVCacheManager
from engine.config import EngineConfig
from engine.core import EngineCore
from engine.outputs import GenerateRequest
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerOutput
from engine.sequence import Sequence, SequenceStatus

BS = 4
TOKEN = 7  # what every "sampled" token is: the tests count steps, not outputs


def make_seq(tenant: str, i: int, prompt_len: int = 8, max_tokens: int = 1000,
             prompt: list[int] | None = None) -> Sequence:
    """A sequence whose prompt is distinct per (tenant, i) unless given: no accidental sharing."""
    tokens = prompt if prompt is not None else [(i * 31 + k) % 997 + 1 for k in range(prompt_len)]
    return Sequence(seq_id=f"{tenant}{i}", request_id=f"{tenant}{i}", index=0, token_ids=list(tokens),
                    params=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                    root_hash=root_hash(tenant.encode(), b"fp"), block_size=BS, tenant=tenant)


def make_scheduler(num_blocks: int = 512, max_num_seqs: int = 4, budget: int = 4096) -> Scheduler:
    return Scheduler(KVCacheManager(num_blocks, BS), max_num_seqs, budget)


def step(sched: Scheduler) -> SchedulerOutput:
    """What EngineCore.step does to the scheduler: compute, sample one token, finish at max_tokens."""
    out = sched.schedule()
    for s in out.scheduled:
        samples = s.samples
        s.seq.num_computed_tokens += s.num_new
        if samples:
            s.seq.append_token(TOKEN)
            if len(s.seq.output_token_ids) >= s.seq.params.max_tokens:
                sched.finish(s.seq, "length")
    return out


def running_by_tenant(sched: Scheduler) -> dict[str, int]:
    counts: dict[str, int] = {}
    for seq in sched.running:
        counts[seq.tenant] = counts.get(seq.tenant, 0) + 1
    return counts


# ---- a flood does not starve another tenant ------------------------------------------------------
def test_flood_from_one_tenant_delays_another_by_one_step():
    sched = make_scheduler(max_num_seqs=4)
    for i in range(20):
        sched.add(make_seq("a", i))
    step(sched)
    assert running_by_tenant(sched) == {"a": 4}
    b = make_seq("b", 0, max_tokens=4)
    sched.add(b)
    out = step(sched)
    assert b.status is SequenceStatus.RUNNING, "b must be admitted in the very next step"
    assert [s.seq_id for s in out.preempted] == ["a3"], "the victim is a's most recently admitted"
    assert sched.preemptions_by_reason == {"blocks": 0, "fairness": 1}
    steps = 1
    while not b.is_finished:
        out = step(sched)
        assert b not in out.preempted
        steps += 1
    assert steps == 4 and b.num_preemptions == 0  # one step per token: b never waited again
    assert sched.preemptions_by_tenant == {"a": 1}


def test_needy_tenant_climbs_to_its_share_and_no_further():
    sched = make_scheduler(max_num_seqs=6)
    for i in range(30):
        sched.add(make_seq("a", i))
    step(sched)
    for i in range(10):
        sched.add(make_seq("b", i))
    history = []
    for _ in range(8):
        step(sched)
        history.append(running_by_tenant(sched))
    # one sequence per step moves from a to b until both hold their share (3 of 6), then it stops
    assert [h["b"] for h in history] == [1, 2, 3, 3, 3, 3, 3, 3]
    assert sched.preemptions_by_reason["fairness"] == 3


def test_fairness_frees_blocks_for_a_tenant_under_its_block_share():
    # a holds all 12 blocks with three 15-token prompts (4 blocks each); b needs one block, and
    # slots are free: the shortage is blocks only.
    sched = make_scheduler(num_blocks=12, max_num_seqs=8)
    for i in range(3):
        sched.add(make_seq("a", i, prompt_len=15))
    step(sched)
    assert sched.manager.num_free_blocks == 0
    b = make_seq("b", 0, prompt_len=3, max_tokens=1)
    sched.add(b)
    out = step(sched)
    assert [s.seq_id for s in out.preempted] == ["a2"]
    assert b.is_finished and b.num_preemptions == 0
    assert sched.preemptions_by_reason == {"blocks": 0, "fairness": 1}
    # a alone again: a lone tenant never preempts itself for fairness (block pressure may, as
    # a's growing sequences need more than the 12 blocks)
    for _ in range(5):
        step(sched)
    assert sched.preemptions_by_reason["fairness"] == 1


def test_a_tenant_admitted_first_is_not_also_a_fairness_victim_in_the_same_step():
    # x: two 31-token prompts (8 blocks each) and, later, a small waiting one; y: one small
    # running sequence and a waiting one needing 3 blocks; 20 blocks. x is under its slot share,
    # so its small sequence goes first and takes a block; y, then short of blocks, may not take
    # them from x in the same step (x's next sequence must stay first in line).
    sched = make_scheduler(num_blocks=20, max_num_seqs=8)
    for seq in (make_seq("x", 0, prompt_len=31), make_seq("x", 1, prompt_len=31), make_seq("y", 0, prompt_len=3)):
        sched.add(seq)
    step(sched)
    assert sched.manager.num_free_blocks == 3
    x2, y1 = make_seq("x", 2, prompt_len=3), make_seq("y", 1, prompt_len=11)
    sched.add(x2)
    sched.add(y1)
    out = step(sched)
    assert out.preempted == [] and x2.status is SequenceStatus.RUNNING
    # next step x is not first in line any more, and every running sequence needs a block too:
    # y takes room from x, newest first, until its sequence fits
    out = step(sched)
    assert [s.seq_id for s in out.preempted] == ["x2", "x1"] and y1.status is SequenceStatus.RUNNING


def test_no_preemption_when_it_would_only_swap_places():
    # 3 slots: a holds 2, b holds 1, both have a backlog. Moving a slot from a to b would make b
    # the heavier one, and the next step would move it back: the rule must leave this alone.
    sched = make_scheduler(max_num_seqs=3)
    for i in range(2):
        sched.add(make_seq("a", i))
    sched.add(make_seq("b", 0))
    for i in range(2, 10):
        sched.add(make_seq("a", i))
        sched.add(make_seq("b", i))
    for _ in range(40):
        step(sched)
        assert running_by_tenant(sched) == {"a": 2, "b": 1}
    assert sched.num_preemptions == 0


def test_one_huge_sequence_is_not_swapped_for_a_needy_one():
    # a's single sequence holds 10 of 12 blocks; b needs 3. Preempting a would leave a with 0,
    # no more than b holds: the swap would only reverse later, so b waits for blocks.
    sched = make_scheduler(num_blocks=12, max_num_seqs=4)
    a = make_seq("a", 0, prompt_len=40, max_tokens=3)
    sched.add(a)
    step(sched)
    b = make_seq("b", 0, prompt_len=12, max_tokens=1)
    sched.add(b)
    out = step(sched)
    assert out.preempted == [] and b.status is SequenceStatus.WAITING
    while not b.is_finished:
        assert step(sched).preempted == []
    assert a.is_finished and sched.num_preemptions == 0


# ---- round-robin order ---------------------------------------------------------------------------
def test_admissions_alternate_between_three_tenants():
    sched = make_scheduler(max_num_seqs=9)
    for tenant in "abc":
        for i in range(3):
            sched.add(make_seq(tenant, i))
    out = step(sched)
    assert [s.seq.seq_id for s in out.scheduled] == ["a0", "b0", "c0", "a1", "b1", "c1", "a2", "b2", "c2"]


def test_round_robin_skips_tenants_whose_queue_emptied_and_keeps_fifo_within_one():
    sched = make_scheduler(max_num_seqs=8)
    for i in range(5):
        sched.add(make_seq("a", i))
    sched.add(make_seq("b", 0))
    sched.add(make_seq("c", 0))
    sched.add(make_seq("c", 1))
    out = step(sched)
    assert [s.seq.seq_id for s in out.scheduled] == ["a0", "b0", "c0", "a1", "c1", "a2", "a3", "a4"]


def test_freed_slots_go_round_robin_between_waiting_tenants():
    sched = make_scheduler(max_num_seqs=2)
    order = []
    for i in range(4):
        sched.add(make_seq("a", i, max_tokens=1))
        sched.add(make_seq("b", i, max_tokens=1))
    while len(sched):
        order += [s.seq.seq_id for s in step(sched).scheduled]
    assert order == ["a0", "b0", "a1", "b1", "a2", "b2", "a3", "b3"]


# ---- preemption order ----------------------------------------------------------------------------
def test_preempted_sequence_resumes_before_its_tenants_other_waiting_ones():
    sched = make_scheduler(max_num_seqs=4)
    for i in range(6):
        sched.add(make_seq("a", i, max_tokens=50))
    step(sched)
    b = make_seq("b", 0, max_tokens=2)
    sched.add(b)
    out = step(sched)
    assert [s.seq_id for s in out.preempted] == ["a3"]
    assert [s.seq_id for s in sched.waiting] == ["a3", "a4", "a5"]
    resumed: list[str] = []
    while not resumed:
        before = set(sched.running)
        step(sched)
        resumed = [s.seq_id for s in sched.running if s not in before]
    assert b.is_finished
    assert resumed == ["a3"], "the slot b leaves goes to a's preempted sequence first"


def test_block_pressure_preempts_the_heaviest_tenant_not_the_newest_sequence():
    # a: two 15-token prompts (4 blocks each); b: a 3-token prompt (1 block); 9 blocks in all.
    # Two decodes later every sequence needs a fifth/second block and none is free. The old rule
    # took the newest running sequence (b's); now the victim is a's newest, a holding 8 blocks.
    sched = make_scheduler(num_blocks=9, max_num_seqs=4)
    a0, a1 = make_seq("a", 0, prompt_len=15), make_seq("a", 1, prompt_len=15)
    b = make_seq("b", 0, prompt_len=3)
    for seq in (a0, a1, b):
        sched.add(seq)
    step(sched)
    step(sched)
    assert sched.manager.num_free_blocks == 0 and sched.num_preemptions == 0
    out = step(sched)
    assert out.preempted == [a1]
    assert {s.seq.seq_id for s in out.scheduled} == {"a0", "b0"}
    assert sched.preemptions_by_reason == {"blocks": 1, "fairness": 0}
    assert sched.waiting.head("a") is a1


def test_block_pressure_never_picks_a_sequence_already_scheduled():
    # b: one 21-token prompt (6 blocks), the heaviest tenant but the one with fewest sequences,
    # so it is scheduled first; a: two 7-token prompts (2 blocks each). 10 blocks in all. Two
    # steps later a0 needs a third block while b still fits its six: b holds the most blocks but
    # is already scheduled, so the victim is a's newest unscheduled sequence.
    sched = make_scheduler(num_blocks=10, max_num_seqs=4)
    a0, a1 = make_seq("a", 0, prompt_len=7), make_seq("a", 1, prompt_len=7)
    b = make_seq("b", 0, prompt_len=21)
    for seq in (a0, a1, b):
        sched.add(seq)
    step(sched)
    step(sched)
    assert sched.manager.num_free_blocks == 0 and sched.num_preemptions == 0
    out = step(sched)
    assert [s.seq.seq_id for s in out.scheduled] == ["b0", "a0"]
    assert out.preempted == [a1]


# ---- one tenant: exactly the old scheduler -------------------------------------------------------
class OldScheduler:
    """A model of the scheduler before tenants existed: one FIFO queue, newest-first preemption."""

    def __init__(self, manager: KVCacheManager, max_num_seqs: int, budget: int) -> None:
        self.manager, self.max_num_seqs, self.budget = manager, max_num_seqs, budget
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def schedule(self) -> tuple[list[tuple[str, int, int]], list[str]]:
        scheduled: list[tuple[Sequence, int, int]] = []
        preempted: list[str] = []
        budget, i = self.budget, 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if self.manager.allocate_slots(seq.seq_id, num_new, seq.num_computed_tokens, (),
                                           seq.block_hashes, seq.token_ids) is not None:
                scheduled.append((seq, seq.num_computed_tokens, num_new))
                budget -= num_new
                i += 1
                continue
            victim = self.running.pop()
            self.manager.free(victim.seq_id)
            victim.num_computed_tokens = 0
            self.waiting.appendleft(victim)
            preempted.append(victim.seq_id)
        if not preempted:
            while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
                seq = self.waiting[0]
                hits: list[Block]
                hits, num_cached = self.manager.get_computed_blocks(seq.block_hashes, seq.num_tokens)
                num_new = min(seq.num_tokens - num_cached, budget)
                if self.manager.allocate_slots(seq.seq_id, num_new, num_cached, hits, seq.block_hashes,
                                               seq.token_ids) is None:
                    break
                self.waiting.popleft()
                seq.num_computed_tokens = num_cached
                self.running.append(seq)
                scheduled.append((seq, num_cached, num_new))
                budget -= num_new
        for seq, start, num_new in scheduled:
            seq.num_computed_tokens = start + num_new
            if start + num_new == seq.num_tokens:
                seq.append_token(TOKEN)
                if len(seq.output_token_ids) >= seq.params.max_tokens:
                    self.finish(seq)
        return [(s.seq_id, start, n) for s, start, n in scheduled], preempted

    def finish(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.manager.free(seq.seq_id)
        seq.status = SequenceStatus.FINISHED


single_tenant_ops = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(1, 30), st.integers(1, 12), st.integers(0, 3)),
        st.tuples(st.just("abort"), st.integers(0, 1000)),
        st.tuples(st.just("step"), st.integers(1, 3)),
    ),
    min_size=1, max_size=40)


@settings(max_examples=60, deadline=None)
@given(ops=single_tenant_ops, tenant=st.sampled_from(["", "a"]), max_num_seqs=st.integers(1, 5),
       num_blocks=st.integers(10, 24), budget=st.sampled_from([4, 8, 16, 64]))
def test_single_tenant_matches_the_old_scheduler_step_for_step(ops, tenant, max_num_seqs, num_blocks, budget):
    new = make_scheduler(num_blocks, max_num_seqs, budget)
    old = OldScheduler(KVCacheManager(num_blocks, BS), max_num_seqs, budget)
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8] * 4, [9, 8, 7, 6, 5, 4, 3, 2] * 4, [5] * 32, [1, 2, 3, 4] * 8]
    pairs: list[tuple[Sequence, Sequence]] = []

    def compare_steps(n: int) -> None:
        for _ in range(n):
            out = step(new)
            got = ([(s.seq.seq_id, s.start, s.num_new) for s in out.scheduled], [s.seq_id for s in out.preempted])
            assert got == old.schedule()

    for op in ops:
        if op[0] == "add":
            _, length, max_tokens, which = op
            length = min(length, num_blocks * BS - max_tokens - BS)  # always fits the pool alone
            if length < 1:
                continue
            made = [make_seq(tenant, len(pairs), max_tokens=max_tokens, prompt=prompts[which][:length])
                    for _ in range(2)]
            new.add(made[0])
            old.add(made[1])
            pairs.append((made[0], made[1]))
        elif op[0] == "abort" and pairs:
            a, b = pairs[op[1] % len(pairs)]
            if not a.is_finished:
                new.finish(a, "abort")
                old.finish(b)
        else:
            compare_steps(op[1])
    for _ in range(2000):
        if not len(new):
            break
        compare_steps(1)
    assert not len(new) and not old.running and not old.waiting
    assert new.preemptions_by_reason["fairness"] == 0


# ---- properties over several tenants -------------------------------------------------------------
multi_tenant_ops = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.sampled_from("abc"), st.integers(1, 12), st.integers(1, 8)),
        st.tuples(st.just("burst"), st.sampled_from("abc"), st.integers(2, 12)),
        st.tuples(st.just("abort"), st.integers(0, 1000)),
        st.tuples(st.just("step"), st.integers(1, 3)),
    ),
    min_size=1, max_size=40)


@settings(max_examples=60, deadline=None)
@given(ops=multi_tenant_ops, max_num_seqs=st.integers(6, 10))
def test_a_tenant_waiting_with_nothing_running_is_scheduled_in_that_step(ops, max_num_seqs):
    """With slots the only scarce resource (3 tenants, >= 2 slots each), a tenant that starts a
    step with waiting sequences and none running gets one scheduled in that very step, whatever
    the others have queued: admitted first when a slot is free, else by a fairness preemption."""
    sched = make_scheduler(num_blocks=4096, max_num_seqs=max_num_seqs, budget=100_000)
    seqs: list[Sequence] = []

    def do_step() -> None:
        running = running_by_tenant(sched)
        starved = {t for t in "abc" if sched.waiting.count(t) and not running.get(t)}
        out = step(sched)
        sched.manager.check_invariants()
        assert len(sched.running) <= max_num_seqs
        served = {s.seq.tenant for s in out.scheduled}
        assert starved <= served, f"{starved - served} got nothing while others held {running}"

    def add(tenant: str, length: int, max_tokens: int) -> None:
        seq = make_seq(tenant, len(seqs), prompt_len=length, max_tokens=max_tokens)
        seqs.append(seq)
        sched.add(seq)

    for op in ops:
        if op[0] == "add":
            add(op[1], op[2], op[3])
        elif op[0] == "burst":
            for _ in range(op[2]):
                add(op[1], 6, 30)
        elif op[0] == "abort" and seqs:
            seq = seqs[op[1] % len(seqs)]
            if not seq.is_finished:
                sched.finish(seq, "abort")
        else:
            for _ in range(op[1]):
                do_step()
    for _ in range(5000):
        if not len(sched):
            break
        do_step()
    assert not len(sched) and all(s.is_finished for s in seqs)
    assert sched.manager.num_blocks_in_use == 0


@settings(max_examples=60, deadline=None)
@given(ops=multi_tenant_ops, max_num_seqs=st.integers(1, 6), num_blocks=st.integers(12, 40),
       budget=st.sampled_from([8, 16, 64]))
def test_tight_pool_with_several_tenants_always_finishes_and_keeps_invariants(ops, max_num_seqs, num_blocks,
                                                                             budget):
    """Blocks, slots and budget all scarce: preemptions of both kinds happen, nothing leaks or is
    lost, and every sequence finishes in a bounded number of steps once arrivals stop."""
    sched = make_scheduler(num_blocks=num_blocks, max_num_seqs=max_num_seqs, budget=budget)
    seqs: list[Sequence] = []

    def do_step() -> None:
        before = {s.seq_id for s in sched.running}
        out = step(sched)
        live = {s.seq_id: (s.root_hash, s.token_ids[: s.num_computed_tokens]) for s in sched.running}
        sched.manager.check_invariants(live)
        assert len(sched.running) <= max_num_seqs
        assert all(s.seq_id in before for s in out.preempted), "only running sequences are preempted"
        assert {s.seq.seq_id for s in out.scheduled}.isdisjoint(s.seq_id for s in out.preempted)
        tracked = [s for s in seqs if not s.is_finished]
        assert sorted(s.seq_id for s in tracked) == sorted(
            [s.seq_id for s in sched.running] + [s.seq_id for s in sched.waiting])

    def add(tenant: str, length: int, max_tokens: int) -> None:
        length = min(length, num_blocks * BS - max_tokens - BS)
        seq = make_seq(tenant, len(seqs), prompt_len=length, max_tokens=max_tokens)
        seqs.append(seq)
        sched.add(seq)

    for op in ops:
        if op[0] == "add":
            add(op[1], op[2], op[3])
        elif op[0] == "burst":
            for _ in range(op[2]):
                add(op[1], 6, 8)
        elif op[0] == "abort" and seqs:
            seq = seqs[op[1] % len(seqs)]
            if not seq.is_finished:
                sched.finish(seq, "abort")
        else:
            for _ in range(op[1]):
                do_step()
    for _ in range(5000):
        if not len(sched):
            break
        do_step()
    assert not len(sched) and all(s.is_finished for s in seqs)
    assert sched.manager.num_blocks_in_use == 0
    assert sum(sched.preemptions_by_reason.values()) == sched.num_preemptions


# ---- the engine: a flood of n=16 requests does not hold up another tenant ------------------------
def _flood_then_small_request(model_dir, tenant_b: str, max_steps: int) -> tuple[int | None, EngineCore]:
    """Tenant "a" sends five n=16 requests of 500 tokens (ignore_eos); three steps later tenant_b
    sends a 4-token request. Returns the number of steps b took (None: not within max_steps)."""
    engine = EngineCore(EngineConfig(model=str(model_dir), block_size=4, num_blocks=256, max_num_seqs=8,
                                     max_num_batched_tokens=64))
    flood = SamplingParams(max_tokens=500, n=16, temperature=1.0, seed=3, ignore_eos=True)
    for r in range(5):
        engine.add_request(GenerateRequest(f"a{r}", [10 + r, 11, 12, 13, 14, 15, 16, 17, 18], flood, tenant="a"))
    for _ in range(3):
        engine.step()
    small = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    engine.add_request(GenerateRequest("b", [40, 41, 42, 43], small, tenant=tenant_b))
    for steps in range(1, max_steps + 1):
        if any(o.request_id == "b" and o.finish_reason is not None for o in engine.step()):
            return steps, engine
    return None, engine


def _drain(engine: EngineCore) -> None:
    for request_id in engine.request_ids():
        engine.abort_request(request_id)
    engine.manager.check_invariants()
    assert engine.manager.num_blocks_in_use == 0 and not engine.has_work()


def test_engine_serves_a_small_request_between_a_flood_from_another_tenant(tiny_model_dir):
    steps, engine = _flood_then_small_request(tiny_model_dir, "b", max_steps=20)
    # one step to be admitted (with its prefill and first token), three more decodes
    assert steps == 4
    stats = engine.stats()
    assert stats["preemptions_by_reason"] == {"blocks": 0, "fairness": 1}
    assert stats["preemptions"] == 1
    usage = stats["tenant_usage"]
    assert usage["a"]["running"] == 7 and usage["a"]["waiting"] == 5 * 16 - 7  # b's slot refills next step
    assert usage["a"]["preemptions"] == 1 and usage["a"]["blocks"] > 0
    assert "b" not in usage  # listed while it has work or once it has lost a sequence
    _drain(engine)


def test_engine_without_tenants_keeps_the_old_fifo_where_the_small_request_waits(tiny_model_dir):
    # the same traffic from one (anonymous) tenant: FIFO, so b queues behind 80 long sequences
    steps, engine = _flood_then_small_request(tiny_model_dir, "a", max_steps=40)
    assert steps is None
    assert engine.stats()["preemptions_by_reason"]["fairness"] == 0
    _drain(engine)


def test_an_idle_tenants_prefill_runs_alone_and_the_busy_tenant_resumes_next_step():
    sched = make_scheduler(max_num_seqs=8)
    for i in range(4):
        sched.add(make_seq("a", i, max_tokens=50))
    step(sched)
    step(sched)
    sched.add(make_seq("b", 0, max_tokens=50))
    sched.add(make_seq("a", 9, max_tokens=50))  # a's own new sequence waits its turn: a is busy
    first = step(sched)
    assert [s.seq.seq_id for s in first.scheduled] == ["b0"]  # b's prefill alone
    sched.add(make_seq("c", 0, max_tokens=50))  # another idle tenant: never two such steps in a row
    second = {s.seq.seq_id: s.num_new for s in step(sched).scheduled}
    assert all(second.get(f"a{i}") == 1 for i in range(4)) and second.get("b0") == 1, second
    third = {s.seq.seq_id for s in step(sched).scheduled}
    assert {"a0", "a1", "a2", "a3", "b0"} <= third  # c was admitted with everyone: no idle tenant left
