"""How blocks go down: writes to the store tiers and the shared tier, in the background
(``persist = "behind"`` or ``"idle"``), and the shutdown flush. The step loop decides; the I/O
loop's writer threads copy and write, bounded by ``max_pending_writes``."""

from __future__ import annotations

import asyncio
import functools
import logging
import queue
import time
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import Executor, Future
from typing import Any

from cache.quota import UNKNOWN
from cache.tiers.base import StoreTier
from cache.tiers.state import ChainState

logger = logging.getLogger(__name__)

# Writes in flight at once while flushing at shutdown: enough to keep the writer threads busy,
# few enough that the payloads waiting for them stay a few tens of MB.
FLUSH_WINDOW = 32
# What a block copy made off the step loop returns when it may be torn and should be made again.
RETRY = b""



class WritePath(ChainState):
    """The write half of `TierChain`."""

    def _write(self, key: bytes, payload: bytes, owner: str = UNKNOWN) -> None:
        """A block leaves host memory: to every store tier, and to the shared tier when it
        writes back.

        Until the stores have indexed it, the block stays readable from ``_writing`` (see
        `recall`); a store that already holds it only marks it as used."""
        self._unpersisted.pop(key, None)
        if not self.admits(key):
            self._not_admitted(key)
            return
        mode = self.shared.write_mode if self.shared is not None else None
        if mode == "back" or (mode == "selective" and key in self._reused):
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
            self._remote_sent[key] = owner
            if len(self._remote_sent) > 65536:
                self._remote_sent.popitem(last=False)
        keys = [k for k, _ in fresh]
        with self._write_lock:
            self._remote_flight.update(dict.fromkeys(keys, owner))
        coro = self._timed(f"{self.shared.name}_put", self.shared.put(fresh, owner), time.perf_counter())
        future = self.io.submit(coro)
        future.add_done_callback(functools.partial(self._remote_done, keys))
        future.add_done_callback(functools.partial(self._write_done, None, None))

    def _remote_done(self, keys: list[bytes], _future: Future[Any]) -> None:
        with self._write_lock:
            for key in keys:
                self._remote_flight.pop(key, None)

    def remote_in_flight(self, keys: Iterable[bytes] = (), owner: str | None = None) -> list[bytes]:
        """Which of ``keys`` (or, with ``owner``, which of that owner's blocks) are being sent to
        the shared tier now: a delete must wait for them, or they land after it (any thread)."""
        with self._write_lock:
            if owner is not None:
                return [k for k, o in self._remote_flight.items() if o == owner]
            return [k for k in keys if k in self._remote_flight]

    def unsend(self, keys: Iterable[bytes] = (), owner: str | None = None) -> None:
        """Forget that ``keys`` (or all of ``owner``'s) were sent to the shared tier, so that they
        are sent again when computed again: they were deleted there (step loop)."""
        if owner is not None:
            keys = [k for k, o in self._remote_sent.items() if o == owner]
        for key in keys:
            self._remote_sent.pop(key, None)

    def remote_wants(self, key: bytes) -> bool:
        """``write = "selective"``: whether a block just reused should be sent to the shared
        tier now (not sent recently)."""
        return self.shared is not None and self.shared.write_mode == "selective" and key not in self._remote_sent

    @property
    def pending_writes(self) -> int:
        return self._pending_writes

    @property
    def writes_behind(self) -> bool:
        """Whether blocks are written in the background as they are computed (``persist =
        "behind"`` or ``"idle"``), not only when they leave host memory."""
        return self.persist != "on_evict"

    def _track(self, key: bytes) -> None:
        """A block entered host memory: written behind, it waits to be written."""
        if self.writes_behind and self.stores and self.admits(key):
            known = self._unpersisted.get(key)  # a computed device block keeps its place and time
            self._unpersisted[key] = (None, known[1] if known is not None else self._clock())

    def _keep_in_host(self, key: bytes) -> bool:
        """Whether host eviction should pass over ``key``: writes are backed up and the block is
        in no store nor on its way there, so evicting it would drop it."""
        return (bool(self.stores) and self._pending_writes >= self.max_pending_writes
                and key not in self._writing and not self._stored(key) and self.admits(key))

    def note_computed(self, key: bytes, copy: Callable[[], bytes | None], owner: str = UNKNOWN) -> None:
        """Written behind (``persist = "behind"`` or ``"idle"``): a device block was just computed;
        ``copy`` (called on a writer thread) returns its bytes, None once the block is gone, or
        `RETRY` when the copy may be torn and should be made again later. With ``admit =
        "second_use"`` only a block used again is taken (or one computed again after being
        dropped)."""
        self._seen_again(key)
        if self.writes_behind and self.stores and key not in self._unpersisted and self.admits(key):
            self._unpersisted[key] = ((copy, owner), self._clock())

    def persist_behind(self, busy: bool = False) -> int:
        """Written behind: start writing the oldest host and computed device blocks not yet on
        disk, while fewer than half the write bound are in flight (demotions keep the other
        half). Called by the step loop between steps; the bytes are copied by a writer thread —
        with ``persist = "idle"`` the idle writer, which runs only on a CPU nobody else wants.
        ``busy``: steps are running back to back, so with ``persist = "behind"`` only blocks
        noted at least ``behind_delay_s`` ago are written now (the rest at the next idle call, or
        once they are that old). Returns how many writes started."""
        io, host = self.io, self.memory
        if not self.writes_behind or not self.stores or io is None:
            return 0
        executor = io.idle_writer if self.persist == "idle" else io.writer
        now = self._clock()
        torn: list[tuple[bytes, Any, float]] = []
        while True:
            try:
                torn.append(self._retry.get_nowait())
            except queue.Empty:
                break
        for key, source, noted in reversed(torn):  # copies found torn go back to the front, in order
            if key not in self._unpersisted:
                self._unpersisted[key] = (source, noted)
                self._unpersisted.move_to_end(key, last=False)
        wait = self.behind_delay_s if busy and self.persist == "behind" else 0.0
        started = 0
        while self._unpersisted and self._pending_writes < max(1, self.max_pending_writes // 2):
            if wait > 0.0 and now - next(iter(self._unpersisted.values()))[1] < wait:
                break  # oldest first: every block behind it is as young or younger
            key, (source, noted) = self._unpersisted.popitem(last=False)
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
            with self._write_lock:
                self._persisting[key] = self._persisting.get(key, 0) + 1
            coro = self._timed(f"{targets[0].name}_write",
                               self._persist(targets, executor, key, copy, owner, source, noted), time.perf_counter())
            io.submit(coro).add_done_callback(functools.partial(self._persisted, key))
            started += 1
        return started

    def _persisted(self, key: bytes, future: Future[Any]) -> None:
        """A background write of ``key`` ended (on the I/O thread), written or not."""
        with self._write_lock:
            left = self._persisting.get(key, 1) - 1
            if left > 0:
                self._persisting[key] = left
            else:
                self._persisting.pop(key, None)
        self._write_done(None, None, future)

    async def _persist(self, stores: list[StoreTier], executor: Executor, key: bytes,
                       copy: Callable[[], bytes | None], owner: str, source: Any, noted: float) -> bool:
        """Copy a block on a thread of ``executor`` and write it to ``stores`` from there. A copy
        that may be torn (the step loop moved the block meanwhile) is never written: a host block
        that left was written by its eviction; a device block is tried again later."""
        payload = await asyncio.get_running_loop().run_in_executor(executor, copy)
        if payload is RETRY:
            if source is not None:
                self._retry.put((key, source, noted))
            return False
        if payload is None:
            return False
        written = await self._write_all(stores, key, payload, owner, executor)
        if written:
            self.stats.persisted_behind += 1
        return written

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
            if key in seen or key in self._writing or not self.admits(key):
                continue
            targets = [store for store in self.stores if key not in store]
            if not targets:
                continue
            payload = get()
            if payload is None:
                continue
            seen.add(key)  # the device and the (inclusive) host may both hold it: write it once
            window.append(io.submit(self._write_all(targets, key, payload, owner, io.writer)))
            if len(window) >= FLUSH_WINDOW:
                written += settle(window.popleft())
        while window:
            written += settle(window.popleft())
        self.stats.flushed_blocks += written
        return written

    @staticmethod
    async def _write_all(stores: list[StoreTier], key: bytes, payload: bytes | memoryview, owner: str,
                         executor: Executor) -> bool:
        """Write one block to each of ``stores`` in turn, on ``executor``; True if any took it."""
        written = False
        for store in stores:
            written = await store.write(key, payload, owner, executor=executor) or written
        return written

    def drain_writes(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while self._pending_writes and time.monotonic() < deadline:
            time.sleep(0.01)
        return not self._pending_writes
