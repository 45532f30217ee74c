"""TierChain: device → host → disk, beside the step loop, with disk I/O on a thread of its own.

    step loop thread                                   I/O thread (asyncio + aiofiles)
    device eviction ─ demote ─▶ host ─ evicted ─▶ write queue ─▶ disk.write (tmp, fsync, rename)
    admission ─ promote ◀─ host (memcpy into a device block)
    add_request ─ prefetch(disk blocks) ─────────────▶ disk.read ─▶ completions
    poll() ◀─ payloads into host, requests released ◀───────────────┘

The step loop never waits on disk: a request whose prefix continues on disk is held back while
its blocks load (other requests keep stepping) and enters the scheduler once they are in host
memory. A block wanted by several requests is read once. Writes are bounded
(``max_pending_writes``): past that, demotions to disk are dropped and counted — back-pressure
instead of unbounded memory. Whether a disk hit is worth loading is decided by measurement:
the disk's running load rate against the engine's prefill rate.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import queue
import threading
import time
from collections.abc import Callable, Hashable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from cache.tiers.disk import DiskTier
from cache.tiers.host import HostTier

logger = logging.getLogger(__name__)


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


@dataclass(slots=True)
class _Waiter:
    token: Hashable
    pending: set[bytes]
    started: float = field(default_factory=time.monotonic)


class IOLoop:
    """An asyncio event loop on a daemon thread; coroutines are submitted from other threads."""

    def __init__(self, name: str = "kvgate-io") -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def submit(self, coro: Any) -> Future[Any]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def close(self) -> None:
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        if not self.loop.is_running():
            self.loop.close()


class TierChain:
    """Host and disk tiers below one device pool (either may be absent)."""

    def __init__(self, host: HostTier | None, disk: DiskTier | None, max_pending_writes: int = 256) -> None:
        self.host = host
        self.disk = disk
        self.max_pending_writes = max_pending_writes
        self.stats = ChainStats()
        self.io = IOLoop() if disk is not None else None
        self._pending_writes = 0
        self._write_lock = threading.Lock()
        self._completed: queue.SimpleQueue[tuple[bytes, bytes | None]] = queue.SimpleQueue()
        self._inflight: set[bytes] = set()
        self._waiters: list[_Waiter] = []
        self._staged: dict[bytes, bytes] = {}  # disk loads waiting for a host slot when host is off

    @property
    def tiers(self) -> list[HostTier | DiskTier]:
        return [t for t in (self.host, self.disk) if t is not None]

    # ---- demotion (step loop) -----------------------------------------------------------------
    def demote(self, key: bytes, src: torch.Tensor) -> None:
        """A device block is being evicted: keep its bytes in the next tier down."""
        self.stats.demotions += 1
        if self.host is not None:
            for victim, payload in self.host.put(key, src):
                self._write(victim, payload)
        elif self.disk is not None:
            self._write(key, src.cpu().numpy().tobytes())

    def _write(self, key: bytes, payload: bytes) -> None:
        if self.disk is None or self.io is None:
            return
        with self._write_lock:
            if self._pending_writes >= self.max_pending_writes:
                self.stats.dropped_writes += 1
                return
            self._pending_writes += 1
        self.io.submit(self.disk.write(key, payload)).add_done_callback(self._write_done)

    def _write_done(self, future: Future[Any]) -> None:
        with self._write_lock:
            self._pending_writes -= 1
        if not future.cancelled() and future.exception() is not None:
            logger.error("disk cache write failed: %s", future.exception())

    @property
    def pending_writes(self) -> int:
        return self._pending_writes

    # ---- promotion (step loop) ----------------------------------------------------------------
    def load(self, key: bytes, dst: torch.Tensor) -> bool:
        """Copy a host-resident (or just prefetched) block into ``dst``; False if neither has it."""
        staged = self._staged.pop(key, None)
        if staged is not None:
            dst.copy_(torch.frombuffer(bytearray(staged), dtype=torch.uint8))
            self.stats.promotions += 1
            return True
        if self.host is not None and self.host.load_into(key, dst):
            self.stats.promotions += 1
            return True
        return False

    def on_lower_tier(self, key: bytes) -> bool:
        return (self.host is not None and key in self.host) or key in self._staged

    # ---- disk prefetch (step loop submits, I/O loop reads) ------------------------------------
    def plan_prefetch(self, keys: Iterable[bytes], block_tokens: int, prefill_tokens_per_s: float | None) -> list[bytes]:
        """The disk-resident blocks that continue a prefix past the host tier, if loading them
        is predicted faster than recomputing their tokens; else []."""
        if self.disk is None:
            return []
        need: list[bytes] = []
        for key in keys:
            if self.on_lower_tier(key) or key in self._inflight:
                continue
            if key not in self.disk:
                break
            need.append(key)
        if need and prefill_tokens_per_s:
            load_s = self.disk.rate.predict_s(len(need) * self.disk.fmt.record_size, len(need))
            compute_s = len(need) * block_tokens / prefill_tokens_per_s
            if load_s >= compute_s:
                self.stats.recompute_chosen += 1
                return []
        return need

    def prefetch(self, token: Hashable, keys: list[bytes], also_wait_for: Iterable[bytes] = ()) -> bool:
        """Start loading ``keys`` from disk; ``token`` is released by ``poll`` when all arrived.

        Returns False when there is nothing to wait for.
        """
        assert self.disk is not None and self.io is not None
        pending = set(keys) | {k for k in also_wait_for if k in self._inflight}
        if not pending:
            return False
        for key in keys:
            if key not in self._inflight:
                self._inflight.add(key)
                self.io.submit(self._read(key))
        self._waiters.append(_Waiter(token, pending))
        self.stats.prefetches += 1
        return True

    async def _read(self, key: bytes) -> None:
        assert self.disk is not None
        try:
            payload = await self.disk.read(key)
        except Exception:  # never leave a waiter hanging
            logger.exception("disk cache read failed")
            payload = None
        self._completed.put((key, payload))

    def poll(self) -> list[Hashable]:
        """Move finished disk loads into host memory; return the tokens whose loads are all done."""
        if not self._waiters and self._completed.empty():
            return []
        arrived: set[bytes] = set()
        while True:
            try:
                key, payload = self._completed.get_nowait()
            except queue.Empty:
                break
            self._inflight.discard(key)
            arrived.add(key)
            if payload is None:
                continue
            self.stats.prefetched_blocks += 1
            if self.host is not None:
                for victim, evicted in self.host.put_bytes(key, payload):
                    self._write(victim, evicted)
            else:
                self._staged[key] = payload
        if not arrived:
            return []
        ready: list[Hashable] = []
        now = time.monotonic()
        still: list[_Waiter] = []
        for waiter in self._waiters:
            waiter.pending -= arrived
            if waiter.pending:
                still.append(waiter)
            else:
                ready.append(waiter.token)
                self.stats.prefetch_wait_s += now - waiter.started
        self._waiters = still
        return ready

    @property
    def loading(self) -> bool:
        return bool(self._waiters)

    def cancel(self, token: Hashable) -> None:
        self._waiters = [w for w in self._waiters if w.token != token]

    # ---- shutdown ---------------------------------------------------------------------------
    def flush(self, blocks: Iterable[tuple[bytes, Callable[[], bytes]]], timeout_s: float) -> int:
        """Write host blocks and the given device blocks (key, payload getter) to disk, waiting up to
        ``timeout_s``; what is already there is skipped. Returns how many blocks were written."""
        if self.disk is None or self.io is None:
            return 0
        deadline = time.monotonic() + timeout_s
        futures = []
        sources: list[tuple[bytes, Callable[[], bytes | None]]] = list(blocks)
        if self.host is not None:
            sources += [(key, functools.partial(self.host.payload, key)) for key in self.host.keys()]
        for key, get in sources:
            if key in self.disk or time.monotonic() > deadline:
                continue
            payload = get()
            if payload is not None:
                futures.append(self.io.submit(self.disk.write(key, payload)))
        written = 0
        for future in futures:
            try:
                written += bool(future.result(timeout=max(0.0, deadline - time.monotonic())))
            except Exception:
                break
        self.stats.flushed_blocks += written
        return written

    def drain_writes(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while self._pending_writes and time.monotonic() < deadline:
            time.sleep(0.01)
        return not self._pending_writes

    def close(self) -> None:
        if self.io is not None:
            self.io.close()
            self.io = None

    # ---- accounting ---------------------------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        out: dict[str, Any] = {"chain": {**_asdict(self.stats), "pending_writes": self._pending_writes,
                                         "inflight_reads": len(self._inflight)}}
        for tier in self.tiers:
            out[tier.name] = {**tier.stats.snapshot(), "blocks": len(tier), "capacity_blocks": tier.capacity_blocks,
                              "bytes": tier.nbytes, "policy": tier.policy_name,
                              "load_bytes_per_s": tier.rate.bytes_per_s, "load_latency_s": tier.rate.latency_s}
        if self.disk is not None:
            out["disk"]["path"] = str(self.disk.dir)
        return out


def _asdict(stats: ChainStats) -> dict[str, Any]:
    return {name: getattr(stats, name) for name in stats.__slots__}  # type: ignore[attr-defined]
