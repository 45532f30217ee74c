"""How a prefetch runs: which store and shared-tier blocks continue a prefix and are worth
loading (step loop), and the job that reads them into reserved memory slots (I/O loop), each
store batch with its deadline (``load_timeout_s``). Every block read, or failed, becomes an
event; `LoadPath.poll` takes them from there.

    step loop                                         I/O loop
    plan_prefetch ─▶ prefetch (reserve slots) ─────▶ _job
                                                      ├ _disk_reads: batches ─▶ store.read_many
                                                      ├ _remote_fetch: exists ─▶ shared.get
    poll (loads.py) ◀─ ("block", key, …), ("done", token, …) ┘
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Hashable, Iterable
from dataclasses import dataclass
from typing import Any

from cache.quota import UNKNOWN
from cache.tiers.base import SharedTier, StoreTier
from cache.tiers.state import JobTimes
from cache.tiers.writes import WritePath

logger = logging.getLogger(__name__)

# A disk load is split into `read_parallel` batches, one worker-thread call each, run at once (a
# request is released when all its blocks are in, so fewer, bigger calls are best: each call costs
# a thread-pool hop); none over this many blocks, so that one call stays short.
READ_BATCH_BLOCKS = 128


@dataclass(frozen=True, slots=True)
class Reservation:
    """A host slot one read fills (`HostTier.reserve`); only that read's event commits or
    releases it, so no other job's result, failure or copy ever touches a slot still being
    written on the I/O thread."""

    host: Any  # the memory tier
    slot: int
    view: memoryview


def _views(reservations: list[Reservation | None]) -> list[memoryview | None]:
    return [r.view if r is not None else None for r in reservations]


class PrefetchPath(WritePath):
    """The prefetch part of `TierChain`'s load half (`LoadPath` adds promotion and polling)."""

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
        """Whether reading ``blocks`` from ``tier`` is predicted faster than recomputing their tokens."""
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
            read = {store.name: n for (store, _), n in zip(own, done[: len(own)], strict=True) if isinstance(n, int)}
            times.blocks = sum(read.values())
            times.by_tier = [(store.name, read[store.name]) for store in self.stores if read.get(store.name)]
            if remote_keys and remote is not None:
                await self._remote_fetch(remote, remote_keys, remote_slots, block_tokens, prefill_tokens_per_s,
                                         times, delivered)
                if delivered:
                    times.by_tier.append((remote.name, len(delivered)))
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
