"""EngineCore: the synchronous heart — validate, schedule, run the model, sample, finish.

No threads and no asyncio here: ``step()`` is one iteration of continuous batching, so tests
drive it directly and ``EngineLoop`` calls it from the thread that built it (engine/loop.py).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch

from cache.hashing import prompt_roots
from cache.kv_storage import KVStorage
from cache.manager import KVCacheManager
from cache.tiers.chain import TierChain
from cache.tiers.codec import BlockFormat
from cache.tiers.control import attach_book
from cache.tiers.factory import RowBank
from engine import snapshot
from engine.cache_control import CacheCommand, CacheControl, Reply
from engine.config import EngineConfig
from engine.errors import InvalidRequestError
from engine.heap import keep_heap_memory
from engine.kv_events import KVEvents
from engine.limits import RequestLimits
from engine.model import LoadedModel, context_limit, load_model, model_fingerprint
from engine.outputs import GenerateRequest, SeqOutput, TokenLogprob
from engine.packing import pack_model, panel_ops
from engine.runner import ModelRunner
from engine.sampler import Sampler, SamplingRow, make_generator
from engine.scheduler import ScheduledSeq, Scheduler
from engine.sequence import Sequence, SequenceStatus
from engine.telemetry import EngineTelemetry, RequestTiming
from engine.tiering import Tiering, host_rows

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class EngineCounters:
    """What the engine did since start; a metrics layer reads these (they only grow)."""

    requests_added: int = 0
    requests_finished: int = 0
    requests_aborted: int = 0
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    reused_tokens: int = 0
    computed_tokens: int = 0
    generated_tokens: int = 0
    steps: int = 0
    step_time_s: float = 0.0
    forward_time_s: float = 0.0
    sample_time_s: float = 0.0
    hash_time_s: float = 0.0


class EngineCore:
    """Owns the model, the KV pool, the cache manager, the scheduler and the sampler."""

    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        self.config = config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.loaded = loaded or load_model(config.model, config.dtype, config.device, direct=config.fast_decoder)
        hf_config = self.loaded.config
        self.max_model_len = context_limit(hf_config, config.max_model_len)
        self.vocab_size = int(hf_config.vocab_size)
        self.block_size = config.block_size
        self.limits = RequestLimits(self.vocab_size, self.max_model_len, config.block_size, config.num_blocks)
        self.storage = KVStorage(
            config.num_blocks, self.loaded.num_layers, config.block_size, self.loaded.num_kv_heads,
            self.loaded.head_dim, dtype=self.loaded.dtype, device=self.loaded.device,
            spare_rows=host_rows(config, self.loaded))
        self.fingerprint = model_fingerprint(self.loaded.model, config.dtype, config.block_size,
                                             self.loaded.kv_shape)
        if config.pack_weights:  # straight into the panel kernel's layout where this machine has its build
            built = self._native_ops(config, build=False)[0]
            pack_model(self.loaded.model, self.loaded.device, self.loaded.dtype,
                       panels=panel_ops(built, self.loaded.dtype))
        if self.loaded.device.type == "cpu":
            keep_heap_memory()  # activations reuse mapped pages instead of faulting in fresh ones
        self.manager = KVCacheManager(config.num_blocks, config.block_size, config.enable_prefix_caching)
        self.manager.pool.life.enabled = config.metrics
        self.scheduler = Scheduler(self.manager, config.max_num_seqs, config.max_num_batched_tokens)
        self.block_format = BlockFormat(self.fingerprint, str(self.storage.dtype).removeprefix("torch."),
                                        self.storage.block_shape)
        self._loading: dict[str, list[Sequence]] = {}
        self._prefill_tps: float | None = None
        self.tiers = Tiering(config, self.storage, self.manager, self.block_format)
        self.scheduler.promote = self._promote
        self.control = CacheControl(self)  # the cache control API: lookups, pins, prefetches, drops
        # a first start compiles the kernels only now: compiling while the weights load and pack
        # made that 3x slower on 2 CPUs (docs/engine.md)
        native, self.kernel_build = self._native_ops(config)
        self.runner = ModelRunner(self.loaded.model, self.storage, native, config.fast_decoder)
        self.sampler = Sampler()
        self.eos_token_ids = frozenset(self.loaded.eos_token_ids)
        self.counters = EngineCounters()
        self.telemetry = EngineTelemetry()
        self._timing: dict[str, RequestTiming] = {}  # requests before their first token
        # Every torch op of the engine runs on the thread that loaded the model (one OpenMP
        # pool per process); step() asserts it and stats() reports both for tests.
        self.owner_thread = threading.get_ident()
        self.step_thread: int | None = None
        self._requests: dict[str, list[Sequence]] = {}
        self._rows: dict[str, SamplingRow] = {}
        # KV events (engine/kv_events.py) when an endpoint is set; started last, so that a start
        # failing before leaves no socket bound
        self.events: KVEvents | None = None
        if config.kv_events_endpoint:
            self.events = KVEvents(config.kv_events_endpoint, config.block_size, config.kv_events_topic,
                                   config.kv_events_max_queue, config.kv_events_replay_endpoint)
            self.events.start(self.manager.pool)
            self.events.wire(self.chain.tiers if self.chain is not None else ())
        logger.info("engine ready", extra={"model": self.loaded.name, "kv_pool_mb": self.storage.nbytes >> 20,
                                            "num_blocks": config.num_blocks, "block_size": config.block_size})

    def _native_ops(self, config: EngineConfig, build: bool = True) -> tuple[Any, Any]:
        """The native CPU ops where they apply (CPU, float32 or bfloat16) and this machine has a build; else,
        where one can be made, None and the `engine.kernels.KernelBuild` compiling it in the
        background, which the step loop switches in once done (engine/loop.py). ``build=False``:
        only a build this machine has, nothing compiled."""
        from engine.model import resolve_device

        if not config.native_kernels or config.dtype not in ("float32", "bfloat16") \
                or resolve_device(config.device).type != "cpu":
            return None, None
        from engine import kernels

        return kernels.load_or_build() if build else (kernels.load_built(), None)

    # ---- tiers below the device (engine/tiering.py) ------------------------------------------
    @property
    def chain(self) -> TierChain | None:
        return self.tiers.chain

    @property
    def rows(self) -> RowBank:
        return self.tiers.rows

    def configure_tier(self, action: str, name: str, options: dict[str, Any] | None = None) -> dict[str, Any]:
        """Attach or detach a tier while serving (`Tiering.configure`); whether a store answers
        is asked before, off the step loop (`AsyncEngine`). A tier attached consults the pins."""
        before = list(self.chain.tiers) if self.chain is not None else []
        reply = self.tiers.configure(action, name, options)
        attach_book(self.chain, self.control.book)
        if self.events is not None:
            after = self.chain.tiers if self.chain is not None else []
            for tier in before:
                if tier not in after:
                    self.events.unwire(tier)
            self.events.wire(after)
        return reply

    def cache_control(self, command: CacheCommand, reply: Reply) -> None:
        """Run a cache control command (engine/cache_control.py); ``reply`` gets the answer, now
        or from the chain's I/O thread once the tier I/O it needs is done."""
        self.control.run(command, reply)

    def spill_device(self) -> int:
        """Demote every idle cached device block to the tiers below and forget it on the device
        (as if other traffic had flushed the pool); returns how many blocks left."""
        return self.tiers.spill_device()

    def _promote(self, seq: Sequence) -> int:
        if self.tiers.chain is None:
            return 0
        t0 = time.perf_counter()
        loaded = self.tiers.promote(seq)
        seq.lower_blocks += loaded
        timing = self._timing.get(seq.request_id) if seq.index == 0 else None
        if loaded and timing is not None:
            timing.load_s += time.perf_counter() - t0
            timing.lower_tier = True
        return loaded

    def poll_loads(self) -> int:
        """Admit the requests whose prefetches finished; returns how many. Also lets the chain
        start its background disk writes (``persist = "behind"`` or ``"idle"``)."""
        control = self.control
        control.tick()
        finished = self.tiers.poll(bool(self._loading) or control.waiting, busy=self.has_work())
        now = time.perf_counter()  # after the poll: every released job ended before it (its parts fit in)
        admitted = 0
        for request_id, times in finished:
            if control.owns(request_id):  # a cache control prefetch, not a request
                control.finished(request_id)
                continue
            self._loaded(request_id, times, now)
            seqs = self._loading.pop(request_id, None)
            for seq in seqs or ():
                seq.fetched = list(times.by_tier) if times is not None else []
                seq.status = SequenceStatus.WAITING
                self.scheduler.add(seq)
            admitted += bool(seqs)
        return admitted

    def _loaded(self, request_id: str, times: Any, now: float) -> None:
        """Book a finished prefetch: its wait is tier load, its remote existence check metadata."""
        timing = self._timing.get(request_id)
        if timing is None or timing.load_started is None:
            return
        exists_s = times.exists_s if times is not None else 0.0
        timing.load_s += max(0.0, now - timing.load_started - exists_s)
        timing.metadata_s += exists_s
        timing.load_started = None
        timing.lower_tier |= times is not None and times.blocks > 0

    def is_loading(self) -> bool:
        """Whether requests (or cache control prefetches) wait for blocks from a lower tier."""
        return bool(self._loading) or self.control.waiting

    def check_invariants(self) -> None:
        """Assert the block accounting (tests call it): the manager's, the tiers', and that every
        KV storage row has exactly one owner."""
        self.manager.check_invariants()
        self.tiers.check_invariants()

    def close(self) -> None:
        """Write what the device and host hold to disk (bounded in time), then stop the I/O and
        publish the last events."""
        self.tiers.close()
        if self.events is not None:
            self.events.close()

    # ---- requests -------------------------------------------------------------------------
    def validate(self, request: GenerateRequest) -> None:
        """Raise a typed error for bad input before anything is allocated (see `RequestLimits`)."""
        self.limits.validate(request)

    def add_request(self, request: GenerateRequest) -> list[Sequence]:
        """Validate and queue a request as ``params.n`` sequences; returns them."""
        self.validate(request)
        if request.request_id in self._requests:
            raise InvalidRequestError(f"request id {request.request_id!r} is already running", param="request_id")
        params = request.params
        self.tiers.set_quota(request.tenant, request.quota, request.namespace_salt)
        self.control.note_request(request.tenant, request.namespace_salt)
        t0 = time.perf_counter()
        timing = RequestTiming(added=t0)
        root, switch = self.roots(request.namespace_salt, request.cache_salt, request.public_prefix_len,
                                  request.public_salt)
        seqs = []
        for i in range(params.n):
            seq = Sequence(
                seq_id=f"{request.request_id}#{i}", request_id=request.request_id, index=i,
                token_ids=list(request.prompt_token_ids), params=params, root_hash=root,
                block_size=self.block_size, generator=make_generator(params.seed, i), tenant=request.tenant,
                switch=switch)
            seqs.append(seq)
        t1 = time.perf_counter()
        self.counters.hash_time_s += t1 - t0
        stop_ids: tuple[int, ...] = ()
        if params.min_tokens:
            stop_ids = tuple({*params.stop_token_ids, *(() if params.ignore_eos else self.eos_token_ids)})
        for seq in seqs:
            self._rows[seq.seq_id] = SamplingRow(params, seq.generator, seq.prompt_token_ids, seq.output_token_ids,
                                                 stop_ids)
        if self.config.metrics:
            self._timing[request.request_id] = timing
        # a decode engine loads every block it can find: recomputing a prompt is the prefill
        # engines' work (no load-or-recompute estimate)
        loading = self.tiers.start_prefetch(request.request_id, seqs[0],
                                            None if self.config.role == "decode" else self._prefill_tps)
        t2 = time.perf_counter()
        timing.metadata_s = t2 - t0  # hashing, and the disk index walk of the prefetch plan
        if loading:
            timing.load_started = t2
            for seq in seqs:
                seq.status = SequenceStatus.LOADING
            self._loading[request.request_id] = seqs
        else:
            for seq in seqs:
                self.scheduler.add(seq)
        self._requests[request.request_id] = seqs
        self.counters.requests_added += 1
        self.counters.prompt_tokens += len(request.prompt_token_ids)
        return seqs

    def roots(self, namespace_salt: bytes, cache_salt: str | None, public_prefix_len: int,
              public_salt: bytes) -> tuple[bytes, tuple[int, bytes] | None]:
        """A prompt's root hash and public-prefix switch (`cache.hashing.extend_block_hashes`):
        the tenant's root, or the public namespace's for the full blocks of a declared public
        prefix (unless the request sent a `cache_salt`), the tenant's root mixed in after them."""
        return prompt_roots(namespace_salt, self.fingerprint, cache_salt, public_prefix_len // self.block_size,
                            public_salt)

    def abort_request(self, request_id: str) -> bool:
        """Stop a request's unfinished choices and free their blocks now; False if unknown."""
        seqs = self._requests.pop(request_id, None)
        if seqs is None:
            return False
        self._timing.pop(request_id, None)
        if self._loading.pop(request_id, None) is not None:
            self.tiers.cancel(request_id)
        for seq in seqs:
            self._drop(seq, "abort")
        self.counters.requests_aborted += 1
        return True

    def abort_sequence(self, request_id: str, index: int, reason: str = "stop") -> None:
        """Finish one choice early (e.g. a stop string matched after detokenization)."""
        seqs = self._requests.get(request_id)
        if seqs is None or index >= len(seqs):
            return
        self._drop(seqs[index], reason)
        self._maybe_retire(request_id)

    def _drop(self, seq: Sequence, reason: str) -> None:
        if not seq.is_finished:
            self.scheduler.finish(seq, reason)
        self._rows.pop(seq.seq_id, None)

    def _maybe_retire(self, request_id: str) -> None:
        seqs = self._requests.get(request_id)
        if seqs is not None and all(s.is_finished for s in seqs):
            del self._requests[request_id]
            self._timing.pop(request_id, None)
            self.counters.requests_finished += 1

    def request_ids(self) -> list[str]:
        """Ids of the requests with unfinished choices."""
        return list(self._requests)

    def has_work(self) -> bool:
        """Whether a step would compute something (requests loading from disk do not count)."""
        return len(self.scheduler) > 0

    @property
    def num_requests(self) -> int:
        return len(self._requests)

    # ---- one step ---------------------------------------------------------------------------
    def step(self) -> list[SeqOutput]:
        """Schedule, run one forward pass, sample, and return the new tokens."""
        t_step = time.perf_counter()
        self.step_thread = threading.get_ident()
        assert self.step_thread == self.owner_thread, "EngineCore.step() must run on the thread that built it"
        lookups_before = self.manager.stats.lookup_time_s
        plan = self.scheduler.schedule()
        if not plan.scheduled:
            return []
        if self._timing:
            self._book_admissions(plan.scheduled, t_step, self.manager.stats.lookup_time_s - lookups_before)
        work = sorted(plan.scheduled, key=lambda s: s.num_new != 1)
        token_ids = [s.seq.token_ids[s.start : s.start + s.num_new] for s in work]
        tables = [self.manager.rows(s.seq.seq_id) for s in work]
        sample_rows = [i for i, s in enumerate(work) if s.samples]
        t_fwd = time.perf_counter()
        logits = self.runner.execute(token_ids, [s.start for s in work], tables, sample_rows)
        t_sample = time.perf_counter()
        self.counters.forward_time_s += t_sample - t_fwd
        num_batched = plan.num_batched_tokens
        if num_batched >= 256:  # a prefill-heavy step: what recomputing a block would cost
            tps = num_batched / max(t_sample - t_fwd, 1e-6)
            self._prefill_tps = tps if self._prefill_tps is None else 0.8 * self._prefill_tps + 0.2 * tps
        for s in work:
            s.seq.num_computed_tokens += s.num_new
            self.counters.computed_tokens += s.num_new
            if s.seq.index == 0 and not s.seq.output_token_ids and s.seq.request_id in self._timing:
                self._timing[s.seq.request_id].prefill_s += t_sample - t_fwd
        self.tiers.after_step(work)
        outputs: list[SeqOutput] = []
        if sample_rows:
            sampled = [work[i] for i in sample_rows]
            result = self.sampler(logits, [self._rows[s.seq.seq_id] for s in sampled])
            t_sampled = time.perf_counter()
            for j, s in enumerate(sampled):
                lp = result.logprobs[j] if result.logprobs is not None else None
                timing = self._timing.pop(s.seq.request_id, None) if s.seq.index == 0 else None
                if timing is not None:
                    self.telemetry.first_token(timing, t_sampled, t_sampled - t_sample)
                outputs.append(self._append(s, result.token_ids[j], lp))
        self.counters.sample_time_s += time.perf_counter() - t_sample
        self.counters.steps += 1
        self.counters.step_time_s += time.perf_counter() - t_step
        return outputs

    def _book_admissions(self, scheduled: list[ScheduledSeq], t_step: float, lookup_s: float) -> None:
        """Requests scheduled for the first time: note when, and share the step's index lookups."""
        fresh = [t for s in scheduled if s.seq.index == 0
                 and (t := self._timing.get(s.seq.request_id)) is not None and t.first_scheduled is None]
        for timing in fresh:
            timing.first_scheduled = t_step
            timing.metadata_s += lookup_s / len(fresh)

    def _append(self, s: ScheduledSeq, token_id: int, logprob: TokenLogprob | None) -> SeqOutput:
        seq = s.seq
        by_tier = None
        if not seq.output_token_ids:
            self.counters.reused_tokens += seq.num_cached_tokens
            if seq.index == 0:
                self.counters.cached_prompt_tokens += seq.num_cached_tokens
                by_tier = self.tiers.served_by_tier(seq)
        seq.append_token(token_id)
        self.counters.generated_tokens += 1
        params = seq.params
        reason = None
        # below min_tokens the sampler masked the stop tokens: only the length can end the choice
        if len(seq.output_token_ids) > params.min_tokens and (
                token_id in params.stop_token_ids or (not params.ignore_eos and token_id in self.eos_token_ids)):
            reason = "stop"
        elif len(seq.output_token_ids) >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            reason = "length"
        if reason is not None:
            self._drop(seq, reason)
            self._maybe_retire(seq.request_id)
        return SeqOutput(seq.request_id, seq.index, token_id, logprob, reason, max(seq.num_cached_tokens, 0), by_tier)

    # ---- accounting -------------------------------------------------------------------------
    @property
    def num_loading(self) -> int:
        """Requests waiting for blocks from a lower tier."""
        return len(self._loading)

    @property
    def prefill_tokens_per_s(self) -> float | None:
        return self._prefill_tps

    def stats(self) -> dict[str, Any]:
        """A snapshot of queue, pool and cache state plus the counters, as plain values
        (the schema: `engine.snapshot.EngineSnapshot`, docs/metrics.md)."""
        return snapshot.take(self).to_dict()

