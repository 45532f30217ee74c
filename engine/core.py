"""EngineCore: the synchronous heart — validate, schedule, run the model, sample, finish.

No threads and no asyncio here: ``step()`` is one iteration of continuous batching, so tests
drive it directly and ``EngineLoop`` calls it from the thread that built it (engine/loop.py).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from cache.hashing import root_hash
from cache.kv_storage import KVStorage
from cache.manager import KVCacheManager
from cache.quota import PUBLIC, UNKNOWN
from cache.tiers import factory
from cache.tiers.chain import RETRY, TierChain
from cache.tiers.codec import BlockFormat
from engine import snapshot
from engine.config import EngineConfig
from engine.errors import InvalidRequestError
from engine.heap import keep_heap_memory
from engine.limits import RequestLimits
from engine.model import LoadedModel, load_model, model_fingerprint
from engine.outputs import GenerateRequest, TokenLogprob
from engine.packing import pack_model
from engine.runner import ModelRunner
from engine.sampler import Sampler, SamplingRow, make_generator
from engine.scheduler import ScheduledSeq, Scheduler
from engine.sequence import Sequence, SequenceStatus
from engine.telemetry import EngineTelemetry, RequestTiming

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class SeqOutput:
    """One new token of one choice, and why the choice ended if it did."""

    request_id: str
    index: int
    token_id: int
    logprob: TokenLogprob | None
    finish_reason: str | None
    num_cached_tokens: int = 0


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
        self.loaded = loaded or load_model(config.model, config.dtype, config.device)
        hf_config = self.loaded.config
        self.max_model_len = min(config.max_model_len, getattr(hf_config, "max_position_embeddings", 1 << 30))
        window = getattr(hf_config, "sliding_window", None)
        if window and getattr(hf_config, "use_sliding_window", True) and window < self.max_model_len:
            logger.warning("model uses sliding-window attention (%d tokens); the paged kernel attends to the "
                           "whole context, so max_model_len is capped at the window", window)
            self.max_model_len = int(window)
        self.vocab_size = int(hf_config.vocab_size)
        self.block_size = config.block_size
        self.limits = RequestLimits(self.vocab_size, self.max_model_len, config.block_size, config.num_blocks)
        self.storage = KVStorage(
            config.num_blocks, self.loaded.num_layers, config.block_size, self.loaded.num_kv_heads,
            self.loaded.head_dim, dtype=self.loaded.dtype, device=self.loaded.device,
            spare_rows=self._host_rows(config))
        # storage rows no device block owns, lent to a host tier sharing the pool's tensor
        self.rows = factory.RowBank(self.storage.slab() if self.storage.device.type == "cpu" else None,
                                    list(self.storage.spare()))
        self.fingerprint = model_fingerprint(self.loaded.model, config.dtype, config.block_size,
                                             self.loaded.kv_shape)
        if config.pack_weights:
            pack_model(self.loaded.model, self.loaded.device, self.loaded.dtype)
        if self.loaded.device.type == "cpu":
            keep_heap_memory()  # activations reuse mapped pages instead of faulting in fresh ones
        self.manager = KVCacheManager(config.num_blocks, config.block_size, config.enable_prefix_caching)
        self.manager.pool.life.enabled = config.metrics
        self.scheduler = Scheduler(self.manager, config.max_num_seqs, config.max_num_batched_tokens)
        self.block_format = BlockFormat(self.fingerprint, str(self.storage.dtype).removeprefix("torch."),
                                        self.storage.block_shape)
        self.chain: TierChain | None = None
        self._loading: dict[str, list[Sequence]] = {}
        self._quotas: dict[str, tuple[dict[str, int], bytes]] = {}  # tenant → (block quota per tier, salt)
        self._prefill_tps: float | None = None
        chain = self._build_chain(config)
        if chain is not None:
            self._use_chain(chain)
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
        logger.info("engine ready", extra={"model": self.loaded.name, "kv_pool_mb": self.storage.nbytes >> 20,
                                            "num_blocks": config.num_blocks, "block_size": config.block_size})

    def _host_rows(self, config: EngineConfig) -> int:
        """Rows to add to the KV tensor for a host tier sharing it (CPU, host tier on), else 0."""
        if not config.share_host_slab or config.host_cache_mb <= 0 or self.loaded.device.type != "cpu":
            return 0
        layers, kv_heads, head_dim = self.loaded.kv_shape
        block_nbytes = layers * 2 * config.block_size * kv_heads * head_dim * self.loaded.dtype.itemsize
        return (config.host_cache_mb << 20) // block_nbytes

    def _native_ops(self, config: EngineConfig) -> tuple[Any, Any]:
        """The native CPU ops where they apply (CPU, float32) and this machine has a build; else,
        where one can be made, None and the `engine.kernels.KernelBuild` compiling it in the
        background, which the step loop switches in once done (engine/loop.py)."""
        from engine.model import resolve_device

        if not config.native_kernels or config.dtype != "float32" or resolve_device(config.device).type != "cpu":
            return None, None
        from engine import kernels

        return kernels.load_or_build()

    # ---- tiers below the device ---------------------------------------------------------------
    def _build_chain(self, config: EngineConfig) -> TierChain | None:
        names = config.tiers_on()
        if not names:
            return None
        tiers = [self._make_tier(name, {}) for name in names]
        logger.info("cache tiers: %s", "; ".join(f"{t.name} {_summary(t)}" for t in tiers))
        return TierChain(tiers, persist=config.disk_persist)

    def _use_chain(self, chain: TierChain) -> None:
        """Put the chain under the device pool: evictions demote into it, admissions promote from it."""
        self.chain = chain
        self.manager.pool.on_evict = self._demote
        self.scheduler.promote = self._promote

    def _make_tier(self, name: str, overrides: dict[str, Any], trusted: bool = True) -> Any:
        """Build a tier from the engine config, ``overrides`` (a request's) on top; ValueError if invalid."""
        options = factory.validate(name, self.config.tier_options().get(name, {}), overrides)
        ctx = factory.BuildContext(self.block_format, self.storage.block_nbytes, self.config.tier_policy,
                                   pin_memory=self.storage.device.type == "cuda",
                                   rows=self.rows,
                                   allowed_root=self.config.disk_allowed_root, trusted=trusted)
        tier = factory.build(name, options, ctx)
        tier.life.enabled = self.config.metrics
        return tier

    def configure_tier(self, action: str, name: str, options: dict[str, Any] | None = None) -> dict[str, Any]:
        """Attach or detach a tier while serving; returns what changed: ``{"ok", "action",
        "tier"}`` plus, after an attach, the tier's ``healthy`` and what it describes of itself
        (`/admin/metrics` has the counters).

        Raises ValueError (bad request) or OSError (e.g. a disk folder that cannot be created).
        Whether a store answers is asked before, off the step loop (`AsyncEngine`).
        """
        factory.kind_of(name)
        if action not in ("attach", "detach"):
            raise ValueError(f"unknown action {action!r}; use attach or detach")
        if self.chain is None:
            self._use_chain(TierChain(persist=self.config.disk_persist))
        chain = self.chain
        assert chain is not None
        if action == "detach":
            tier = chain.detach(name, self.config.flush_on_shutdown_s)
            if getattr(tier, "shared", False):  # a memory tier on the pool's rows: they wait for the next one
                self.rows.give_back(tier.rows() - tier.reserved_rows(), tier.reserved_rows())
        else:
            if chain.tier(name) is not None:
                raise ValueError(f"the {name} tier is already attached; detach it first")
            tier = self._make_tier(name, dict(options or {}), trusted=False)
            try:
                chain.attach(tier)
            except ValueError:
                if getattr(tier, "shared", False):
                    self.rows.give_back(tier.rows(), set())
                raise
            for tenant in self._quotas:
                self._apply_quota(tenant)
        logger.info("cache tier %s %sed", name, action)
        reply: dict[str, Any] = {"ok": True, "action": action, "tier": name}
        if action == "attach":
            detail = tier.describe()
            reply.update({k: detail[k] for k in ("path", "url", "unhealthy_reason") if detail.get(k) is not None})
            reply["healthy"] = detail.get("healthy", True)
            if tier.capacity_blocks:
                reply["capacity_blocks"] = tier.capacity_blocks
        return reply

    def _apply_quota(self, tenant: str) -> None:
        """Give every tier the tenant's latest block quota (`cache.quota`); a tier without one in
        the request's quota is unlimited for it. A shared store keeps its quotas under a tag that
        only this server's secret links to the tenant."""
        quota, salt = self._quotas[tenant]
        self.manager.pool.ledger.set_limit(tenant, quota.get("device"))
        chain = self.chain
        if chain is None:
            return
        tag = hashlib.blake2b(tenant.encode(), key=salt[:64], digest_size=12, person=b"kvgate-owner").hexdigest()
        for tier in chain.tiers:
            tier.apply_quota(tenant, tag, quota.get(tier.name))

    def _demote(self, block: Any, block_hash: bytes) -> None:
        assert self.chain is not None
        owner = self.manager.pool.ledger.owner_of(block_hash) or UNKNOWN
        row = self.chain.demote(block_hash, self.storage.block_view(block.slot), owner, block.slot)
        if row is not None:  # the host tier kept the block's row and gave it one of its own
            block.slot = row

    def _promote(self, seq: Sequence) -> int:
        t0 = time.perf_counter()
        loaded = self.manager.promote(seq.block_hashes, seq.num_tokens, self._load_block,
                                      seq.tenant, seq.public_blocks)
        timing = self._timing.get(seq.request_id) if seq.index == 0 else None
        if loaded and timing is not None:
            timing.load_s += time.perf_counter() - t0
            timing.lower_tier = True
        return loaded

    def _load_block(self, block_hash: bytes, block_id: int) -> bool:
        assert self.chain is not None
        block = self.manager.pool.blocks[block_id]
        row = self.chain.take(block_hash, block.slot)
        if row is not None:  # the host tier handed over the row holding it: nothing copied
            block.slot = row
            return True
        return self.chain.load(block_hash, self.storage.block_view(block.slot))

    def _start_prefetch(self, request_id: str, seq: Sequence) -> bool:
        """If the prompt's prefix continues on disk, start loading it; True = the request waits."""
        chain = self.chain
        if chain is None or chain.io is None or not self.config.enable_prefix_caching:
            return False
        rest = list(self.manager.missing_hashes(seq.block_hashes, seq.num_tokens))
        if not rest:
            return False
        chain.recall(rest, seq.tenant)  # blocks whose disk writes are still in flight: back into host
        need = chain.plan_prefetch(rest, self.block_size, self._prefill_tps)
        remote_keys = rest[chain.local_end(rest):] if chain.shared is not None else []
        return chain.prefetch(request_id, need, also_wait_for=rest, remote_keys=remote_keys,
                              block_tokens=self.block_size, prefill_tokens_per_s=self._prefill_tps,
                              owner=seq.tenant)

    def _filled_blocks(self, work: list[ScheduledSeq]) -> Iterator[tuple[Any, bytes, str]]:
        """(block, its hash, its owner) for each hashed block this step filled."""
        for s in work:
            lo, hi = s.start // self.block_size, (s.start + s.num_new) // self.block_size
            for i, block in enumerate(self.manager.blocks(s.seq.seq_id)[lo:hi], lo):
                if block.block_hash is not None:
                    yield block, block.block_hash, PUBLIC if i < s.seq.public_blocks else s.seq.tenant

    def _write_through(self, work: list[ScheduledSeq]) -> None:
        """Send the blocks this step filled to the remote tier (write-through mode)."""
        assert self.chain is not None
        by_owner: dict[str, list[tuple[bytes, bytes]]] = {}
        for block, key, owner in self._filled_blocks(work):
            by_owner.setdefault(owner, []).append((key, self.storage.read_block(block.slot)))
        for owner, items in by_owner.items():
            self.chain.write_remote(items, owner)

    @property
    def _persist_computed(self) -> bool:
        """Whether computed device blocks are written to disk in the background (``persist =
        "behind"``, a disk tier, and KV in CPU memory, which a writer thread can copy from)."""
        chain = self.chain
        return (chain is not None and chain.persist == "behind" and chain.store is not None
                and self.storage.device.type == "cpu")

    def _note_computed(self, work: list[ScheduledSeq]) -> None:
        """Offer the blocks this step filled to the chain's background writer."""
        assert self.chain is not None
        for block, key, owner in self._filled_blocks(work):
            self.chain.note_computed(key, functools.partial(self._copy_device_block, block, key, block.slot), owner)

    def _copy_device_block(self, block: Any, key: bytes, slot: int) -> bytes | None:
        """A cached device block's bytes, copied on a writer thread: None once the block no longer
        holds ``key`` in ``slot``; `RETRY` when a block was allocated during the copy (its row
        may have been reused and rewritten, so the copy may be torn). A cached block's row is
        written only after an allocation takes it, and allocations are counted before that."""
        allocations = self.manager.pool.stats.allocations
        if block.block_hash != key or block.slot != slot:
            return None
        data = self.storage.block_view(slot).numpy().tobytes()
        if block.block_hash != key or block.slot != slot:
            return None
        return data if self.manager.pool.stats.allocations == allocations else RETRY

    def poll_loads(self) -> int:
        """Admit the requests whose disk loads finished; returns how many. Also lets the chain
        start its background disk writes (``persist = "behind"``)."""
        if self.chain is None:
            return 0
        self.chain.persist_behind()
        if not self._loading:
            return 0
        admitted = 0
        released = self.chain.poll()
        now = time.perf_counter()  # after the poll: every released job ended before it (its parts fit in)
        for token in released:
            self._loaded(str(token), now)
            seqs = self._loading.pop(str(token), None)
            for seq in seqs or ():
                seq.status = SequenceStatus.WAITING
                self.scheduler.add(seq)
            admitted += bool(seqs)
        return admitted

    def _loaded(self, request_id: str, now: float) -> None:
        """Book a finished prefetch: its wait is tier load, its remote existence check metadata."""
        assert self.chain is not None
        times = self.chain.finished_jobs.pop(request_id, None)
        timing = self._timing.get(request_id)
        if timing is None or timing.load_started is None:
            return
        exists_s = times.exists_s if times is not None else 0.0
        timing.load_s += max(0.0, now - timing.load_started - exists_s)
        timing.metadata_s += exists_s
        timing.load_started = None
        timing.lower_tier |= times is not None and times.blocks > 0

    def is_loading(self) -> bool:
        return bool(self._loading)

    def spill_device(self) -> int:
        """Demote every idle cached device block to the tiers below and forget it on the device
        (as if other traffic had flushed the pool); returns how many blocks left."""
        pool = self.manager.pool
        idle = [(h, b) for h, b in pool.cached_blocks() if b.ref_cnt == 0]
        if self.chain is not None:
            for block_hash, block in idle:
                self._demote(block, block_hash)
        pool.evict_all_cached()
        return len(idle)

    def check_invariants(self) -> None:
        """Assert the block accounting (tests call it): the manager's, the host tier's, and that
        every KV storage row has exactly one owner — a device block, the host tier, or the spare
        list (rows a detached host tier's reads still fill excepted)."""
        self.manager.check_invariants()
        host = self.chain.memory if self.chain is not None else None
        if host is not None:
            host.check_invariants()
        owners = [b.slot for b in self.manager.pool.blocks] + self.rows.owners()
        if host is not None and host.shared:
            owners += sorted(host.rows())
        assert sorted(owners) == list(range(self.storage.num_rows)), "a storage row has no owner or two"

    def close(self) -> None:
        """Write what the device and host hold to disk (bounded in time), then stop the I/O."""
        chain = self.chain
        if chain is None:
            return
        if chain.store is not None and self.config.flush_on_shutdown_s > 0:
            storage = self.storage
            ledger = self.manager.pool.ledger
            blocks = [(h, lambda b=b: storage.read_block(b.slot), ledger.owner_of(h) or UNKNOWN)
                      for h, b in self.manager.pool.cached_blocks()]
            t0 = time.monotonic()
            written = chain.flush(blocks, self.config.flush_on_shutdown_s)
            drained = chain.drain_writes(self.config.flush_on_shutdown_s)
            logger.info("cache tiers flushed %d blocks to disk in %.1f s (%d blocks there in all)%s", written,
                        time.monotonic() - t0, len(chain.store),
                        "" if drained else f"; {chain.pending_writes} writes still in flight were abandoned")
        chain.close()

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
        if request.tenant and (request.quota or request.tenant in self._quotas):
            self._quotas[request.tenant] = (dict(request.quota), request.namespace_salt)
            self._apply_quota(request.tenant)
        t0 = time.perf_counter()
        timing = RequestTiming(added=t0)
        root = root_hash(request.namespace_salt, self.fingerprint, request.cache_salt)
        switch = None
        public_blocks = request.public_prefix_len // self.block_size
        if public_blocks and request.public_salt and request.cache_salt is None:
            root, switch = root_hash(request.public_salt, self.fingerprint), (public_blocks, root)
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
        loading = self._start_prefetch(request.request_id, seqs[0])
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

    def abort_request(self, request_id: str) -> bool:
        """Stop a request's unfinished choices and free their blocks now; False if unknown."""
        seqs = self._requests.pop(request_id, None)
        if seqs is None:
            return False
        self._timing.pop(request_id, None)
        if self._loading.pop(request_id, None) is not None and self.chain is not None:
            self.chain.cancel(request_id)
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
        if self.chain is not None and self.chain.writes_through:
            self._write_through(work)
        if self._persist_computed:
            self._note_computed(work)
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
        if not seq.output_token_ids:
            self.counters.reused_tokens += seq.num_cached_tokens
            if seq.index == 0:
                self.counters.cached_prompt_tokens += seq.num_cached_tokens
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
        return SeqOutput(seq.request_id, seq.index, token_id, logprob, reason, max(seq.num_cached_tokens, 0))

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


def _summary(tier: Any) -> str:
    """A tier in a log line: where it keeps its blocks and how many fit (never a password)."""
    detail = tier.describe()
    where = detail.get("path") or detail.get("url")
    size = f"{tier.capacity_blocks} blocks ({tier.capacity_blocks * tier.block_nbytes >> 20} MiB)" \
        if tier.capacity_blocks and hasattr(tier, "block_nbytes") else \
        (f"{tier.capacity_blocks} blocks" if tier.capacity_blocks else "")
    return " ".join(part for part in (str(where) if where else "", size) if part)
