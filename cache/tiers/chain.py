"""TierChain: the tiers below the device pool, beside the step loop, with their I/O on a thread
of its own. Tiers take part by the role they declare (cache.tiers.base): one ``memory`` tier
(host slots), any number of ``store`` tiers (local, indexed), one ``shared`` tier.

    step loop thread                                     I/O thread (asyncio)
    device eviction ─ demote ─▶ memory ─ evicted ─▶ writes ─▶ every store (tmp, fsync, rename)
    admission ─ promote ◀─ memory (copy, or a row traded on CPU)
    add_request ─ prefetch(store blocks, memory slots) ─▶ store.read_many ─▶ completions
                            (the rest: exists + get) ─▶ shared.get ───────▶ completions
    poll() ◀─ slots indexed in memory, requests released ◀─────────────────────┘

The step loop never waits on I/O: a request whose prefix continues in a store is held back
while its blocks load (other requests keep stepping) and enters the scheduler once they are in
memory: the loop reserves a slot per block and the I/O thread reads straight into it, in
batches, several batches at once. A block wanted by several requests is read once, from the
first store that holds it. Writes are bounded (``max_pending_writes``): past that they are
dropped and counted — back-pressure instead of unbounded memory. Whether a hit is worth loading
is decided by measurement: the tier's running load rate against the engine's prefill rate.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import queue
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy
import torch

from cache.quota import UNKNOWN
from cache.telemetry import OpTimes
from cache.tiers.base import SharedTier, StoreTier, Tier

logger = logging.getLogger(__name__)

# A disk load is split into `read_parallel` batches, one worker-thread call each, run at once (a
# request is released when all its blocks are in, so fewer, bigger calls are best: each call costs
# a thread-pool hop); none over this many blocks, so that one call stays short.
READ_BATCH_BLOCKS = 128
# Writes in flight at once while flushing at shutdown: enough to keep the writer threads busy,
# few enough that the payloads waiting for them stay a few tens of MB.
FLUSH_WINDOW = 32
# What a block copy made off the step loop returns when it may be torn and should be made again.
RETRY = b""


# How host blocks reach the disk tier: "on_evict" writes a block when it leaves host memory;
# "behind" also writes host blocks in the background, oldest first, so a crash (SIGKILL, OOM kill,
# power cut) loses only the blocks of the last moments, and evicting them later costs no write.
PERSIST_MODES = ("on_evict", "behind")


@dataclass(slots=True)
class ChainStats:
    demotions: int = 0
    promotions: int = 0
    prefetches: int = 0
    prefetched_blocks: int = 0
    prefetch_wait_s: float = 0.0
    recompute_chosen: int = 0
    dropped_writes: int = 0
    flushed_blocks: int = 0
    recalled_blocks: int = 0  # asked for while their disk write was in flight: served from its buffer
    persisted_behind: int = 0  # host and computed device blocks written to disk by persist = "behind"


@dataclass(frozen=True, slots=True)
class Reservation:
    """A host slot one read fills (`HostTier.reserve`); only that read's event commits or
    releases it, so no other job's result, failure or copy ever touches a slot still being
    written on the I/O thread."""

    host: Any  # the memory tier
    slot: int
    view: memoryview


def _copy_into(dst: torch.Tensor, payload: bytes | memoryview) -> None:
    """Copy a block's bytes into ``dst`` (flat uint8, on any device)."""
    view = memoryview(payload).cast("B")
    if not view.readonly:
        dst.copy_(torch.frombuffer(view, dtype=torch.uint8))
    elif dst.device.type == "cpu":  # torch wants a writable buffer; numpy copies from a read-only one
        dst.numpy()[:] = numpy.frombuffer(view, dtype=numpy.uint8)
    else:
        dst.copy_(torch.frombuffer(bytearray(view), dtype=torch.uint8))


def _views(reservations: list[Reservation | None]) -> list[memoryview | None]:
    return [r.view if r is not None else None for r in reservations]


@dataclass(slots=True)
class JobTimes:
    """How a prefetch went: issue to release, time in tier I/O, time in remote existence checks."""

    issue_to_done_s: float = 0.0
    io_s: float = 0.0
    exists_s: float = 0.0
    blocks: int = 0  # blocks this job's own reads delivered


# How much lower than the step loop the background writers run (Linux `nice`): writes are
# demotions and write-throughs nobody waits for, and on a small machine every core they take is
# taken from the step's OpenMP threads, which then also wait for each other at every barrier.
# At +10 a writer gets about a tenth of a busy core's share and still keeps up with serving's
# write rates (tens of MB/s). Measured on 2 cores with a co-located Redis, a 128-block
# write-through beside a 64-token device hit: our threads' part is now ~30 ms of CPU; the hit
# still goes 137-143 -> 205-233 ms, because redis-server's own ~60-70 ms of receiving (another
# process, at normal priority) lands on the same two cores.
BACKGROUND_NICE = 10


def _deprioritise() -> None:
    """Lower the calling thread's CPU priority by `BACKGROUND_NICE` (where the OS allows it)."""
    try:
        me = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, me, min(19, os.getpriority(os.PRIO_PROCESS, me) + BACKGROUND_NICE))
    except (AttributeError, OSError):  # not Linux, or not permitted: the writes run at normal priority
        pass


class IOLoop:
    """An asyncio event loop on a daemon thread; coroutines are submitted from other threads.

    Below normal CPU priority, for the work nobody waits for: ``writer`` (2 threads) writes disk
    files, ``sender`` (1 thread) sends remote writes' bytes — apart, so that a slow ``fsync``
    never holds a write-through other replicas are waiting to see. Reads stay on the loop and
    its default executor, at normal priority: a request waits for them."""

    def __init__(self, name: str = "kvgate-io") -> None:
        self.loop = asyncio.new_event_loop()
        self.writer = ThreadPoolExecutor(max_workers=2, thread_name_prefix=f"{name}-write",
                                         initializer=_deprioritise)
        self.sender = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"{name}-send",
                                         initializer=_deprioritise)
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def submit(self, coro: Any) -> Future[Any]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    async def _shutdown(self) -> None:
        """Cancel the reads and writes still queued or in flight and let them unwind here, on their
        own loop, then stop. Abandoned with the loop, they would be finalised later by the garbage
        collector on whichever thread runs it, where aiofiles' clean-up submits to that thread's
        loop's executor, which can deadlock it (seen with a second chain's I/O thread)."""
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self.loop.stop()

    def close(self) -> None:
        if self.thread.is_alive():
            self.submit(self._shutdown())
        self.thread.join(10)
        if not self.loop.is_running():
            self.loop.close()
        self.writer.shutdown(wait=False, cancel_futures=True)
        self.sender.shutdown(wait=False, cancel_futures=True)


class TierChain:
    """The tiers below one device pool, in order, each in the part of the data path its
    `TierTraits.role` names (cache.tiers.base): at most one tier per role, any of them absent."""

    def __init__(self, tiers: Iterable[Tier | None] = (), *, max_pending_writes: int = 256,
                 read_parallel: int = min(4, os.cpu_count() or 1), persist: str = "on_evict") -> None:
        if persist not in PERSIST_MODES:
            raise ValueError(f"persist must be one of {', '.join(PERSIST_MODES)}, got {persist!r}")
        self.memory: Any = None  # the `memory` tier (host slots), or None
        self.stores: list[Any] = []  # the `store` tiers (local, indexed stores), top down
        self.shared: Any = None  # the `shared` tier (a store other replicas reach), or None
        self.max_pending_writes = max_pending_writes
        self.persist = persist
        self.stats = ChainStats()
        # Store writes in flight, key -> the payload being written: the block stays readable from
        # here until every store it goes to has indexed it (the I/O thread indexes, then forgets
        # it); `_writing_to` names those stores
        self._writing: dict[bytes, bytes | memoryview] = {}
        self._writing_to: dict[bytes, set[str]] = {}
        # blocks that may not be on disk yet, oldest first (persist = "behind" writes them): host
        # blocks (None: copied from their slot) and computed device blocks ((copy, owner))
        self._unpersisted: OrderedDict[bytes, tuple[Callable[[], bytes | None], str] | None] = OrderedDict()
        self._retry: queue.SimpleQueue[tuple[bytes, Any]] = queue.SimpleQueue()  # torn device copies
        self.io: IOLoop | None = None
        self._pending_writes = 0
        self._write_lock = threading.Lock()
        # ("block", key, (payload | None, its Reservation | None)) and ("done", token, JobTimes),
        # in the order they happened
        self._events: queue.SimpleQueue[tuple[str, Any, Any]] = queue.SimpleQueue()
        self._inflight: set[bytes] = set()  # disk keys being read (step-loop view)
        self._reads: dict[bytes, asyncio.Future[int]] = {}  # the same, on the I/O loop
        self._remote_reads: dict[bytes, asyncio.Future[bool]] = {}  # remote GETs in flight (I/O loop)
        self.read_parallel = read_parallel
        self._read_slots = asyncio.Semaphore(read_parallel)  # disk read batches at once (I/O loop)
        self._jobs: set[Hashable] = set()
        self._job_started: dict[Hashable, float] = {}
        self._staged: dict[bytes, bytes | memoryview] = {}  # loads waiting for a host slot when host is off
        self._owners: dict[bytes, str] = {}  # whom a block being loaded is for (step-loop view)
        self._job_keys: dict[Hashable, list[bytes]] = {}
        self._remote_sent: OrderedDict[bytes, None] = OrderedDict()  # recently written to remote
        # issue-to-done vs transfer time per kind of operation (gap metric 3)
        self.ops = {"prefetch": OpTimes()}  # and per tier: <store>_read, <store>_write, <shared>_put
        self.finished_jobs: dict[Hashable, JobTimes] = {}  # what poll() released, for the engine to take
        for tier in tiers:
            if tier is not None:
                self.attach(tier)

    @property
    def tiers(self) -> list[Any]:
        """The attached tiers, top down."""
        return [t for t in (self.memory, *self.stores, self.shared) if t is not None]

    @property
    def store(self) -> Any:
        """The first store tier (where a shutdown's flush is counted), or None."""
        return self.stores[0] if self.stores else None

    def _stored(self, key: bytes) -> bool:
        """Whether a store tier holds ``key`` (an exact index lookup, no I/O)."""
        return any(key in store for store in self.stores)

    def _source(self, key: bytes) -> Any:
        """The first store tier holding ``key``, or None."""
        return next((store for store in self.stores if key in store), None)

    def tier(self, name: str) -> Any:
        """The attached tier called ``name``, or None."""
        return next((t for t in self.tiers if t.name == name), None)

    @property
    def writes_through(self) -> bool:
        """Whether freshly computed blocks go to the shared tier at once (vs when leaving host)."""
        return self.shared is not None and self.shared.write_mode == "through"

    # ---- demotion (step loop) -----------------------------------------------------------------
    def demote(self, key: bytes, src: torch.Tensor, owner: str = UNKNOWN, row: int | None = None) -> int | None:
        """A device block of ``owner`` is being evicted: keep its bytes in the next tier down.

        ``row``: the pool row holding it. When the host tier shares the pool's slab it takes that
        row instead of a copy, and the return value is the row the pool block uses from now on
        (None: the block keeps its own row)."""
        self.stats.demotions += 1
        host = self.memory
        if host is not None and host.shared and row is not None:
            traded = host.adopt(key, row, owner)
            if traded is not None:
                spare, evicted = traded
                self._track(key)
                for victim, payload, victim_owner in evicted:
                    self._write(victim, payload, victim_owner)
                return spare
        if host is not None:
            for victim, payload, victim_owner in host.put(key, src, owner):
                self._write(victim, payload, victim_owner)
            if key in host:
                self._track(key)
        elif self.stores or self.shared is not None:
            self._write(key, src.cpu().numpy().tobytes(), owner)
        return None

    def _write(self, key: bytes, payload: bytes, owner: str = UNKNOWN) -> None:
        """A block leaves host memory: to every store tier, and to the shared tier when it
        writes back.

        Until the stores have indexed it, the block stays readable from ``_writing`` (see
        `recall`); a store that already holds it only marks it as used."""
        self._unpersisted.pop(key, None)
        if self.shared is not None and self.shared.write_mode == "back":
            self.write_remote([(key, payload)], owner)
        for store in self.stores:
            self._write_to(store, key, payload, owner)

    def _write_to(self, store: StoreTier, key: bytes, payload: bytes | memoryview, owner: str) -> bool:
        """Start writing ``key`` to ``store`` unless it holds the block, is being sent it, or its
        quota or the write bound refuses; True if the write started."""
        if self.io is None or store.name in self._writing_to.get(key, ()) or not store.ledger.admits(owner):
            return False
        if store.touch(key) or not self._reserve_write(1):
            return False
        with self._write_lock:
            self._writing[key] = payload
            self._writing_to.setdefault(key, set()).add(store.name)
        coro = self._timed(f"{store.name}_write", store.write(key, payload, owner, executor=self.io.writer),
                           time.perf_counter())
        self.io.submit(coro).add_done_callback(functools.partial(self._write_done, key, store.name))
        return True

    async def _timed(self, kind: str, coro: Any, issued: float) -> Any:
        """Run a tier call on the I/O loop, timed from ``issued`` (when the step loop asked) and alone."""
        start = time.perf_counter()
        try:
            return await coro
        finally:
            end = time.perf_counter()
            self.ops[kind].observe(end - issued, end - start)

    def _reserve_write(self, blocks: int) -> bool:
        """Count one more write in flight, or drop ``blocks`` (counted) when the bound is reached."""
        with self._write_lock:
            if self._pending_writes >= self.max_pending_writes:
                self.stats.dropped_writes += blocks
                return False
            self._pending_writes += 1
            return True

    def _write_done(self, key: bytes | None, store: str | None, future: Future[Any]) -> None:
        """A write ended (on the I/O thread): the store indexed the block first, so dropping its
        buffer once the last store has leaves no moment in which none holds it."""
        if key is not None:
            with self._write_lock:
                targets = self._writing_to.get(key)
                if targets is not None:
                    targets.discard(store or "")
                    if not targets:
                        del self._writing_to[key]
                        self._writing.pop(key, None)
        with self._write_lock:
            self._pending_writes -= 1
        if not future.cancelled() and future.exception() is not None:
            logger.error("cache write failed: %s", future.exception())

    def write_remote(self, items: list[tuple[bytes, bytes]], owner: str = UNKNOWN) -> None:
        """Send ``owner``'s blocks to the remote tier in one pipeline (dropped and counted past
        the bound)."""
        if self.shared is None or self.io is None or not items:
            return
        unstored = self.shared.unstored
        while unstored:  # a write failed or a quota deleted them: send them again when asked
            self._remote_sent.pop(unstored.popleft(), None)
        fresh = [(k, p) for k, p in items if k not in self._remote_sent]
        if not fresh or not self._reserve_write(len(fresh)):
            return
        for key, _ in fresh:
            self._remote_sent[key] = None
            if len(self._remote_sent) > 65536:
                self._remote_sent.popitem(last=False)
        coro = self._timed(f"{self.shared.name}_put", self.shared.put(fresh, owner), time.perf_counter())
        self.io.submit(coro).add_done_callback(functools.partial(self._write_done, None, None))

    @property
    def pending_writes(self) -> int:
        return self._pending_writes

    # ---- promotion (step loop) ----------------------------------------------------------------
    def load(self, key: bytes, dst: torch.Tensor) -> bool:
        """Copy a host-resident (or just prefetched) block into ``dst``; False if neither has it."""
        staged = self._staged.pop(key, None)
        if staged is not None:
            _copy_into(dst, staged)  # (a Redis reply is writable: no extra copy)
            self.stats.promotions += 1
            return True
        if self.memory is not None and self.memory.load_into(key, dst):
            self.stats.promotions += 1
            return True
        writing = self._writing.get(key)
        if writing is not None:  # its disk write is still in flight: copy from the write's buffer
            _copy_into(dst, writing)
            self.stats.promotions += 1
            self.stats.recalled_blocks += 1
            return True
        return False

    def take(self, key: bytes, row: int) -> int | None:
        """Promote a host block without a copy (a host tier sharing the pool's slab): returns the
        row that holds it, which the pool block uses from now on (its old ``row`` goes to the
        host); None if the host has no such block (then `load` copies a staged one, if any)."""
        host = self.memory
        if host is None or not host.shared or key not in host:
            return None
        held = host.surrender(key, row)
        self.stats.promotions += 1
        return held

    def on_lower_tier(self, key: bytes) -> bool:
        """Whether the block can be promoted without a read: in host, staged, or being written."""
        return (self.memory is not None and key in self.memory) or key in self._staged or key in self._writing

    def recall(self, keys: Iterable[bytes], owner: str = UNKNOWN) -> int:
        """Bring the leading ``keys`` whose disk writes are still in flight back into host memory
        (or staging), copied from the write's buffer, so the request that wants them finds them
        there when it is admitted, whenever the write ends. Stops at the first key no tier can
        supply; returns how many blocks came back."""
        recalled = 0
        for key in keys:
            payload = self._writing.get(key)  # (before the disk: the I/O thread indexes, then forgets)
            if payload is None:
                if self.on_lower_tier(key) or key in self._inflight or self._stored(key):
                    continue
                break
            if self.memory is None:
                self._staged[key] = payload
            else:
                for victim, evicted, victim_owner in self.memory.put_bytes(key, payload, owner):
                    self._write(victim, evicted, victim_owner)
            recalled += 1
        self.stats.recalled_blocks += recalled
        return recalled

    # ---- persistence (step loop decides, writer threads copy and write) -----------------------
    def _track(self, key: bytes) -> None:
        """A block entered host memory: with ``persist = "behind"`` it waits to be written."""
        if self.persist == "behind" and self.stores:
            self._unpersisted[key] = None

    def _keep_in_host(self, key: bytes) -> bool:
        """Whether host eviction should pass over ``key``: writes are backed up and the block is
        in no store nor on its way there, so evicting it would drop it."""
        return (bool(self.stores) and self._pending_writes >= self.max_pending_writes
                and key not in self._writing and not self._stored(key))

    def note_computed(self, key: bytes, copy: Callable[[], bytes | None], owner: str = UNKNOWN) -> None:
        """``persist = "behind"``: a device block was just computed; ``copy`` (called on a writer
        thread) returns its bytes, None once the block is gone, or `RETRY` when the copy may be
        torn and should be made again later."""
        if self.persist == "behind" and self.stores and key not in self._unpersisted:
            self._unpersisted[key] = (copy, owner)

    def persist_behind(self) -> int:
        """``persist = "behind"``: start writing the oldest host and computed device blocks not
        yet on disk, while fewer than half the write bound are in flight (demotions keep the
        other half). Called by the step loop between steps; the bytes are copied by a writer
        thread. Returns how many writes started."""
        io, host = self.io, self.memory
        if self.persist != "behind" or not self.stores or io is None:
            return 0
        while True:  # copies found torn go to the back of the line
            try:
                key, source = self._retry.get_nowait()
            except queue.Empty:
                break
            self._unpersisted.setdefault(key, source)
        started = 0
        while self._unpersisted and self._pending_writes < max(1, self.max_pending_writes // 2):
            key, source = self._unpersisted.popitem(last=False)
            writing = self._writing_to.get(key, ())
            targets = [store for store in self.stores if key not in store and store.name not in writing]
            if not targets:
                continue
            slot = host.slot_of(key) if host is not None else None
            if slot is not None:
                assert host is not None
                copy: Callable[[], bytes | None] = functools.partial(host.snapshot, key, slot)
                owner = host.ledger.owner_of(key) or UNKNOWN
            elif source is not None:
                copy, owner = source
            else:  # left host since (its eviction wrote it)
                continue
            targets = [store for store in targets if store.ledger.admits(owner)]
            if not targets or not self._reserve_write(1):
                continue
            coro = self._timed(f"{targets[0].name}_write", self._persist(targets, io, key, copy, owner, source),
                               time.perf_counter())
            io.submit(coro).add_done_callback(functools.partial(self._write_done, None, None))
            started += 1
        return started

    async def _persist(self, stores: list[StoreTier], io: IOLoop, key: bytes, copy: Callable[[], bytes | None],
                       owner: str, source: Any) -> bool:
        """Copy a block on a writer thread and write it to ``stores``. A copy that may be torn
        (the step loop moved the block meanwhile) is never written: a host block that left was
        written by its eviction; a device block is tried again later."""
        payload = await asyncio.get_running_loop().run_in_executor(io.writer, copy)
        if payload is RETRY:
            if source is not None:
                self._retry.put((key, source))
            return False
        if payload is None:
            return False
        written = await self._write_all(stores, key, payload, owner, io)
        if written:
            self.stats.persisted_behind += 1
        return written

    # ---- prefetch from disk and remote (step loop submits, I/O loop reads) --------------------
    def plan_prefetch(self, keys: Iterable[bytes], block_tokens: int, prefill_tokens_per_s: float | None) -> list[bytes]:
        """The store-resident blocks that continue a prefix past the host tier, if loading them
        is predicted faster than recomputing their tokens; else []."""
        if not self.stores:
            return []
        need: list[bytes] = []
        per_store: dict[str, int] = {}
        for key in keys:
            if self.on_lower_tier(key) or key in self._inflight:
                continue
            source = self._source(key)
            if source is None:
                break
            need.append(key)
            per_store[source.name] = per_store.get(source.name, 0) + 1
        # the stores read at once: loading takes as long as the slowest of them
        if need and not all(self._worth_loading(self.tier(name), n, block_tokens, prefill_tokens_per_s)
                            for name, n in per_store.items()):
            self.stats.recompute_chosen += 1
            return []
        return need

    def local_end(self, keys: list[bytes]) -> int:
        """How many leading ``keys`` the host, a staged load, a read in flight or the disk can supply."""
        for i, key in enumerate(keys):
            if not (self.on_lower_tier(key) or key in self._inflight or self._stored(key)):
                return i
        return len(keys)

    @staticmethod
    def _worth_loading(tier: Any, blocks: int, block_tokens: int, prefill_tokens_per_s: float | None) -> bool:
        if not prefill_tokens_per_s:
            return True
        load_s = tier.rate.predict_s(blocks * tier.fmt.record_size, blocks)
        return load_s < blocks * block_tokens / prefill_tokens_per_s

    def prefetch(self, token: Hashable, keys: list[bytes], also_wait_for: Iterable[bytes] = (),
                 remote_keys: Iterable[bytes] = (), block_tokens: int = 16,
                 prefill_tokens_per_s: float | None = None, owner: str = UNKNOWN) -> bool:
        """Start loading ``keys`` from the store tiers (and look up ``remote_keys`` in the shared tier);
        ``poll`` releases ``token`` once everything it waits for has arrived. Blocks it brings
        into host memory are held there for ``owner``.

        Returns False when there is nothing to wait for.
        """
        keys = [k for k in dict.fromkeys(keys) if k not in self._inflight] if self.stores else []
        also_wait_for = list(also_wait_for)
        waits = [k for k in also_wait_for if k in self._inflight and k not in keys]
        # distinct, like ``keys``: each gets at most one reserved slot, and `_job` tells filled ones by key
        remote = list(dict.fromkeys(remote_keys)) if self.shared is not None else []
        if not keys and not waits and not remote:
            return False
        assert self.io is not None
        if self.memory is not None:  # the request's blocks already in host must not make room for the rest
            for key in also_wait_for:
                self.memory.touch(key)
        slots = [self._reserve_slot(owner) for _ in keys]
        # remote blocks may not exist: they get only slots that are free now (a miss costs no host block)
        remote_slots = [self._reserve_slot(owner, evict=False) for _ in remote]
        self._inflight.update(keys)
        for key in (*keys, *remote):
            self._owners.setdefault(key, owner)
        self._job_keys[token] = [*keys, *remote]
        self._jobs.add(token)
        self._job_started[token] = time.monotonic()
        # each block is read from the first store that holds it (one gone meanwhile: a miss there)
        groups: dict[str, tuple[Any, list[bytes], list[Reservation | None]]] = {}
        for key, slot in zip(keys, slots, strict=True):
            store = self._source(key) or self.stores[0]
            group = groups.setdefault(store.name, (store, [], []))
            group[1].append(key)
            group[2].append(slot)
        self.io.submit(self._job(token, list(groups.values()), waits, remote, remote_slots, block_tokens,
                                 prefill_tokens_per_s, self.shared, time.perf_counter()))
        self.stats.prefetches += 1
        return True

    def _reserve_slot(self, owner: str, evict: bool = True) -> Reservation | None:
        """A host slot for one read to land in (no copy afterwards), or None: the block then
        arrives in a buffer of its own and is copied in by `poll`."""
        if self.memory is None:
            return None
        reserved = self.memory.reserve(owner, evict)
        if reserved is None:
            return None
        slot, view, evicted = reserved
        for victim, payload, victim_owner in evicted:
            self._write(victim, payload, victim_owner)
        return Reservation(self.memory, slot, view)

    async def _job(self, token: Hashable, groups: list[tuple[Any, list[bytes], list[Reservation | None]]],
                   waits: list[bytes], remote_keys: list[bytes], remote_slots: list[Reservation | None],
                   block_tokens: int, prefill_tokens_per_s: float | None, remote: SharedTier | None,
                   issued: float) -> None:
        # the tiers are captured when the job is submitted: a detach meanwhile cannot pull them away
        times = JobTimes()
        delivered: set[bytes] = set()
        try:
            t0 = time.perf_counter()
            # every read's future exists before this job first waits: a later job waits on them
            own = [(store, self._disk_reads(keys, slots, store, issued)) for store, keys, slots in groups]
            shared = [self._reads[k] for k in waits if k in self._reads]
            done = await asyncio.gather(*(self._settle_reads(store, reads, t0) for store, reads in own), *shared,
                                        return_exceptions=True)
            times.blocks = sum(n for n in done[: len(own)] if isinstance(n, int))
            if remote_keys and remote is not None:
                await self._remote_fetch(remote, remote_keys, remote_slots, block_tokens, prefill_tokens_per_s,
                                         times, delivered)
            times.io_s = time.perf_counter() - t0
        except Exception:  # never leave a waiter hanging
            logger.exception("cache prefetch failed")
        finally:
            for key, reserved in zip(remote_keys, remote_slots, strict=True):
                if reserved is not None and key not in delivered:  # not filled: `poll` frees the slot
                    self._events.put(("block", key, (None, reserved)))
            self._events.put(("done", token, times))

    async def _settle_reads(self, store: StoreTier, reads: list[asyncio.Future[int]], t0: float) -> int:
        """Wait for one store's reads of a job and feed its load-rate estimate; the blocks read."""
        done = await asyncio.gather(*reads, return_exceptions=True)
        nbytes = sum(n for n in done if isinstance(n, int) and n > 0)
        if self.STALLED in done:  # as if all it asked for took that long
            nbytes = len(reads) * store.fmt.record_size
        if nbytes:  # the rate of the batch as issued: reads overlap
            store.rate.observe(nbytes, time.perf_counter() - t0, ops=len(reads))
        return sum(1 for n in done if isinstance(n, int) and n > 0)

    def _disk_reads(self, keys: list[bytes], slots: list[Reservation | None], disk: StoreTier,
                    issued: float) -> list[asyncio.Future[int]]:
        """Read ``keys`` (distinct, none in flight: `prefetch` sees to that) into ``slots``, in
        batches, at most `read_parallel` batches at once; other jobs may wait on the same futures
        (runs on the I/O loop)."""
        loop = asyncio.get_running_loop()
        futures = []
        for key in keys:
            self._reads[key] = future = loop.create_future()
            futures.append(future)
        if keys:  # as many batches as reads may run at once, none over READ_BATCH_BLOCKS
            per_batch = min(READ_BATCH_BLOCKS, -(-len(keys) // self.read_parallel))
            for i in range(0, len(keys), per_batch):
                batch = slice(i, i + per_batch)
                asyncio.ensure_future(self._read_batch(keys[batch], slots[batch], disk, issued))
        return futures

    async def _read_batch(self, keys: list[bytes], slots: list[Reservation | None], disk: StoreTier,
                          issued: float) -> None:
        """Read a batch (its blocks go to the event queue) and settle each key's future with the
        bytes read, or `STALLED` once the batch ran past ``disk.load_timeout_s``, counted from
        here (waiting for a read slot included): the waiters then go on and recompute.

        A read on its thread cannot be stopped. Past the deadline it goes on alone (`_read_into`,
        shielded) and gives its read slot back; its host slots stay reserved — no one else is
        given a slot it may still write into — until it returns, when its blocks are committed
        (or their slots released) by the usual events. Its keys stay in flight meanwhile, so a
        stuck file is not asked for again (later requests recompute those blocks at once)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + disk.load_timeout_s
        read: asyncio.Future[list[int]] | None = None
        sizes = [0] * len(keys)
        try:
            await asyncio.wait_for(self._read_slots.acquire(), disk.load_timeout_s)
            try:
                read = asyncio.ensure_future(self._read_into(keys, slots, disk, issued))
                sizes = await asyncio.wait_for(asyncio.shield(read), max(0.0, deadline - loop.time()))
            finally:
                self._read_slots.release()
        except asyncio.TimeoutError:
            sizes = [self.STALLED] * len(keys)
            disk.note_stall(len(keys))
        except Exception:  # (a cancellation at shutdown is not one: it still settles the futures below)
            logger.exception("disk cache read failed")
        finally:
            if read is None:  # never started: its host slots are free again
                for key, reserved in zip(keys, slots, strict=True):
                    self._events.put(("block", key, (None, reserved)))
            for key, n in zip(keys, sizes, strict=True):
                future = self._reads.pop(key, None)
                if future is not None and not future.done():
                    future.set_result(n)

    async def _remote_fetch(self, remote: SharedTier, keys: list[bytes], slots: list[Reservation | None],
                            block_tokens: int, prefill_tokens_per_s: float | None, times: JobTimes,
                            delivered: set[bytes]) -> None:
        """Check which leading ``keys`` the store holds and GET them (into ``slots``, the host
        slots reserved for them, where given); each block fetched is an event for `poll`, its key
        added to ``delivered``."""
        t0 = time.perf_counter()
        present = await remote.exists(keys)
        times.exists_s = time.perf_counter() - t0
        n = 0
        while n < len(present) and present[n]:
            n += 1
        if not n:
            return
        if not self._worth_loading(remote, n, block_tokens, prefill_tokens_per_s):
            self.stats.recompute_chosen += 1
            return
        # a block another job is already getting is waited for, not fetched twice
        loop = asyncio.get_running_loop()
        wanted = list(dict.fromkeys(keys[:n]))
        shared = [self._remote_reads[k] for k in wanted if k in self._remote_reads]
        fresh = [k for k in wanted if k not in self._remote_reads]
        for key in fresh:
            self._remote_reads[key] = loop.create_future()
        payloads: list[memoryview | None] = [None] * len(fresh)
        slot_of = dict(zip(keys, slots, strict=True))
        try:
            if fresh:
                payloads = await remote.get(fresh, _views([slot_of[k] for k in fresh]))
        finally:
            complete = True  # blocks after a missing one continue no prefix: not loaded
            for key, payload in zip(fresh, payloads, strict=True):
                complete = complete and payload is not None
                if complete:
                    self._events.put(("block", key, (payload, slot_of[key])))
                    delivered.add(key)
                    times.blocks += 1
                future = self._remote_reads.pop(key)
                if not future.done():
                    future.set_result(complete)
        if shared:
            await asyncio.gather(*shared, return_exceptions=True)

    def poll(self) -> list[Hashable]:
        """Move finished loads into host memory; return the tokens whose loads are all done."""
        if not self._jobs and self._events.empty():
            return []
        ready: list[Hashable] = []
        now = time.monotonic()
        while True:
            try:
                kind, item, payload = self._events.get_nowait()
            except queue.Empty:
                break
            if kind == "done":
                for key in self._job_keys.pop(item, ()):
                    self._owners.pop(key, None)
                if item in self._jobs:
                    self._jobs.discard(item)
                    ready.append(item)
                    waited = now - self._job_started.pop(item, now)
                    self.stats.prefetch_wait_s += waited
                    payload.issue_to_done_s = waited
                    self.ops["prefetch"].observe(waited, payload.io_s)
                    self.finished_jobs[item] = payload
                    if len(self.finished_jobs) > 4096:  # nobody takes them (a chain used on its own)
                        del self.finished_jobs[next(iter(self.finished_jobs))]
                continue
            key = item
            payload, reserved = payload  # the slot this read went into, if it had one
            self._inflight.discard(key)
            if payload is None:
                if reserved is not None:
                    reserved.host.release(reserved.slot)
                continue
            self.stats.prefetched_blocks += 1
            if reserved is not None:
                host = reserved.host
                for victim, evicted, victim_owner in host.commit(key, reserved.slot, self._owners.get(key, UNKNOWN),
                                                                 payload):
                    if host is self.memory:  # (a host detached meanwhile takes its blocks with it)
                        self._write(victim, evicted, victim_owner)
                if host is self.memory:
                    self._track(key)  # (from the remote tier; one read from disk is skipped later)
            elif self.memory is not None:
                for victim, evicted, victim_owner in self.memory.put_bytes(key, payload, self._owners.get(key, UNKNOWN)):
                    self._write(victim, evicted, victim_owner)
                self._track(key)
            else:
                self._staged[key] = payload
        return ready

    @property
    def loading(self) -> bool:
        return bool(self._jobs)

    def cancel(self, token: Hashable) -> None:
        self._jobs.discard(token)
        self._job_started.pop(token, None)
        self.finished_jobs.pop(token, None)

    # ---- attach and detach at run time (step loop) ----------------------------------------------
    def attach(self, tier: Tier) -> None:
        """Put a tier in the place its role names (the place must be empty); starts the I/O loop
        if the tier needs one."""
        role = tier.traits.role
        if self.tier(tier.name) is not None:
            raise ValueError(f"the {tier.name} tier is already attached; detach it first")
        if role != "store" and getattr(self, role) is not None:
            raise ValueError(f"a {role} tier ({getattr(self, role).name}) is already attached; detach it first")
        placed: Any = tier  # (the memory tier's eviction hook, the shared tier's sender thread)
        if role == "store":
            self.stores.append(tier)
            self.ops.setdefault(f"{tier.name}_read", OpTimes())
            self.ops.setdefault(f"{tier.name}_write", OpTimes())
        else:
            setattr(self, role, tier)
        if role == "memory":
            placed.keep = self._keep_in_host
        elif self.io is None:
            self.io = IOLoop()
        if role == "shared":
            assert self.io is not None
            placed.write_executor = self.io.sender
            self.ops.setdefault(f"{tier.name}_put", OpTimes())

    def detach(self, name: str, flush_timeout_s: float = 10.0) -> Any:
        """Take the tier called ``name`` out and return it. Host blocks are written to the store
        first (when there is one); a detached store keeps its files (attaching the folder again
        finds them); in-flight reads finish on the tier they started on."""
        tier = self.tier(name)
        if tier is None:
            raise ValueError(f"the {name} tier is not attached")
        role = tier.traits.role
        if role == "memory" and self.stores:
            self.flush([], flush_timeout_s)
        if role == "store":
            self.stores.remove(tier)
        else:
            setattr(self, role, None)
        if role == "memory":
            self._staged.clear()
            self._unpersisted.clear()
            tier.keep = None
        if role == "shared":
            self._close_remote(tier)
        return tier

    def _close_remote(self, remote: SharedTier) -> None:
        if self.io is None:
            return
        try:
            self.io.submit(remote.close()).result(timeout=5)
        except Exception:  # a dead connection may fail to close; it is dropped either way
            pass

    # ---- shutdown ---------------------------------------------------------------------------
    def flush(self, blocks: Iterable[tuple[Any, ...]], timeout_s: float) -> int:
        """Write host blocks and the given device blocks ((key, payload getter) or (key, getter,
        owner)) to the store tiers, waiting up to ``timeout_s``; what is already there (or on its way) is
        skipped. Call it while nothing else changes the tiers (the step loop is here): host slots
        are written from where they lie, with at most `FLUSH_WINDOW` writes in flight so memory
        stays bounded. Returns how many blocks were written."""
        io = self.io
        if not self.stores or io is None:
            return 0
        deadline = time.monotonic() + timeout_s
        sources: list[tuple[bytes, Callable[[], bytes | memoryview | None], str]] = [
            (entry[0], entry[1], entry[2] if len(entry) > 2 else UNKNOWN) for entry in blocks]
        if self.memory is not None:
            host = self.memory
            sources += [(key, functools.partial(host.view, key), host.ledger.owner_of(key) or UNKNOWN)
                        for key in host.keys()]
        seen: set[bytes] = set()
        window: deque[Future[Any]] = deque()
        written = 0

        def settle(future: Future[Any]) -> int:
            try:
                return int(bool(future.result(timeout=max(0.0, deadline - time.monotonic()))))
            except Exception:  # past the deadline, or the write failed (counted by the tier)
                return 0

        for key, get, owner in sources:
            if time.monotonic() > deadline:
                break
            if key in seen or key in self._writing:
                continue
            targets = [store for store in self.stores if key not in store]
            if not targets:
                continue
            payload = get()
            if payload is None:
                continue
            seen.add(key)  # the device and the (inclusive) host may both hold it: write it once
            window.append(io.submit(self._write_all(targets, key, payload, owner, io)))
            if len(window) >= FLUSH_WINDOW:
                written += settle(window.popleft())
        while window:
            written += settle(window.popleft())
        self.stats.flushed_blocks += written
        return written

    @staticmethod
    async def _write_all(stores: list[StoreTier], key: bytes, payload: bytes | memoryview, owner: str,
                         io: IOLoop) -> bool:
        """Write one block to each of ``stores`` in turn; True if any took it."""
        written = False
        for store in stores:
            written = await store.write(key, payload, owner, executor=io.writer) or written
        return written

    def drain_writes(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while self._pending_writes and time.monotonic() < deadline:
            time.sleep(0.01)
        return not self._pending_writes

    def close(self) -> None:
        if self.io is not None:
            if self.shared is not None:
                self._close_remote(self.shared)
            self.io.close()
            self.io = None

    # ---- accounting ---------------------------------------------------------------------------
    def telemetry(self) -> dict[str, Any]:
        """The gap metrics the chain measures: op timings, block lives, remote access pattern, and
        the bytes that describe blocks against the bytes of blocks moved."""
        out: dict[str, Any] = {"ops": {kind: op.snapshot() for kind, op in self.ops.items()},
                               "life": {t.name: t.life.snapshot() for t in self.tiers},
                               "metadata_bytes": {t.name: t.stats.metadata_bytes for t in self.tiers},
                               "data_bytes": {t.name: t.stats.bytes_read + t.stats.bytes_written for t in self.tiers}}
        if self.shared is not None:
            out["remote_access"] = self.shared.access.snapshot()
        return out

    def snapshot(self) -> dict[str, Any]:
        """``{"chain": counters, <tier name>: that tier's state, ...}``, tiers top down; each tier's
        entry has its counters, occupancy, cost model, ``traits`` and what `describe` adds."""
        out: dict[str, Any] = {"chain": {**_asdict(self.stats), "pending_writes": self._pending_writes,
                                         "inflight_reads": len(self._inflight), "persist": self.persist,
                                         "unpersisted_blocks": len(self._unpersisted)}}
        for tier in self.tiers:
            detail = tier.describe()  # first: a tier may recover (a disk folder) while it looks
            out[tier.name] = {**tier.stats.snapshot(), "blocks": len(tier), "capacity_blocks": tier.capacity_blocks,
                              "bytes": tier.nbytes, "policy": tier.policy_name,
                              "load_bytes_per_s": tier.rate.bytes_per_s, "load_latency_s": tier.rate.latency_s,
                              "load_samples": tier.rate.samples, "load_sample_age_s": tier.rate.age_s(),
                              "traits": tier.traits.to_dict(), **detail}
        return out

    # ---- hostile folders ----------------------------------------------------------------------
    STALLED = -1  # what a read future settles with when its batch ran past the deadline

    async def _read_into(self, keys: list[bytes], slots: list[Reservation | None], disk: StoreTier,
                         issued: float) -> list[int]:
        """Read a batch into its host slots and put each block (None where it failed) in the event
        queue, however late; the bytes read per key (I/O loop)."""
        payloads: list[memoryview | None] = [None] * len(keys)
        try:
            payloads = await self._timed(f"{disk.name}_read", disk.read_many(keys, _views(slots)), issued)
        except Exception:
            logger.exception("disk cache read failed")
        finally:
            for key, payload, reserved in zip(keys, payloads, slots, strict=True):
                self._events.put(("block", key, (payload, reserved)))
        return [len(p) if p is not None else 0 for p in payloads]


def _asdict(stats: ChainStats) -> dict[str, Any]:
    return {name: getattr(stats, name) for name in stats.__slots__}  # type: ignore[attr-defined]
