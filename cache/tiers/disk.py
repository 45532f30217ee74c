"""DiskTier: one file per KV block under a folder, written atomically, indexed in memory.

    <path>/<first 16 hex digits of the model fingerprint>/<block hash hex>.kvb

    disk.py         DiskTier: reads, writes, health (the chain's I/O loop and any thread)
    disk_index.py   DiskIndex: the blocks the folder holds, eviction order, owners, the folder
    disk_files.py   one block file: named, scanned, read and checked, written atomically

Files hold `codec` records (header + payload), written with the tier's codec (`kv_codec`: the
payload encoded on the writer thread) and read whatever codec they were written with (decoded on
the reader thread, into the destination slot). Reads and writes are coroutines run on the chain's
I/O event loop, never on the step loop; each batch of file work is one call on a worker thread.
Writes are demotions nobody waits for, so they run on the chain's writer threads, below the step
loop's CPU priority. Capacity is counted in bytes of records as stored (`DiskIndex`). A
corrupt, truncated or foreign file is a miss: it is deleted and counted. I/O errors (read-only
folder, disk full) are counted and logged once per kind; the block is simply not stored.

The folder may be hostile or broken (disk_files.py says how files are opened). Reads run on the
tier's own `ReaderPool`: the chain gives each read batch a deadline (``load_timeout_s``), and a
read stuck past it does not take the pool. A folder that vanished is recreated (its blocks are
counted lost); while it cannot be, `health` says why.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import time
from collections.abc import Sequence
from concurrent.futures import Executor
from pathlib import Path
from typing import Any

from cache.quota import UNKNOWN, pick_victim
from cache.tiers.base import TierTraits
from cache.tiers.codec import HEADER_SIZE, BlockFormat, CorruptBlockError, UndecodableBlockError
from cache.tiers.disk_files import SUFFIX, Loaded, read_files, temp_path, unlink, write_record_async
from cache.tiers.disk_index import DiskIndex
from cache.tiers.options import LOAD_TIMEOUT_S
from cache.tiers.readers import ReaderPool, ReadersStalled
from cache.tiers.stats import RateEstimate

__all__ = ["SUFFIX", "DiskTier"]

logger = logging.getLogger(__name__)

STALL_LOG_EVERY_S = 60.0  # at most one warning per this long about loads past the deadline


class DiskTier(DiskIndex):
    """A store tier on a local folder: `DiskIndex` says what it holds, this half moves the bytes."""

    name = "disk"
    traits = TierTraits(locality="node-ssd", lifetime="persistent", substrate="nvme-fs", shared=False, role="store")

    def __init__(self, path: str | Path, capacity_bytes: int, fmt: BlockFormat, policy: str = "lru",
                 load_timeout_s: float = LOAD_TIMEOUT_S, read_threads: int = min(4, os.cpu_count() or 1),
                 codec: str = "none") -> None:
        if load_timeout_s <= 0:
            raise ValueError(f"load_timeout_s must be positive, got {load_timeout_s!r}")
        # the deadline the chain gives each read batch; a reader thread past it no longer counts
        self.load_timeout_s = load_timeout_s
        self.readers = ReaderPool(read_threads, 4 * read_threads, load_timeout_s, name="kvgate-disk-read")
        # observed per prefetch batch by the chain (reads overlap, so one read's time says little)
        self.rate = RateEstimate(bytes_per_s=500e6, latency_s=2e-3)
        self._logged: set[str] = set()
        self._stall_logged = -STALL_LOG_EVERY_S
        super().__init__(path, capacity_bytes, fmt, policy, codec)

    # ---- I/O (the chain's I/O loop) -----------------------------------------------------------
    async def read(self, key: bytes) -> memoryview | None:
        """The block's payload, or None (missing, unreadable, or corrupt: then deleted)."""
        return (await self.read_many([key]))[0]

    async def read_many(self, keys: Sequence[bytes], into: Sequence[memoryview | None] | None = None
                        ) -> list[memoryview | None]:
        """Payloads of ``keys`` in order (None: missing, unreadable, or corrupt: then deleted).
        ``into`` may give, per key, a writable buffer of the payload's size (a reserved host slot)
        that the payload is read straight into; the result is then a view of it.

        The files are opened, read and checked by one call on a reader thread (`_read_files` on
        `readers`): aiofiles' file objects cost three thread-pool hops per block (open, read,
        close), which took more time than the reads themselves. The chain runs several
        such batches at once (reads release the GIL, so they overlap). Each payload is a writable
        view into the buffer its file was read into: no copy is made between the file and the
        host slot it goes to. When every reader thread is stuck the batch fails at once (counted
        as read errors): the request recomputes instead of queueing behind a hung disk.
        """
        dests = list(into) if into is not None else [None] * len(keys)
        with self._lock:
            wanted = [(key, dest) for key, dest in zip(keys, dests, strict=True) if key in self._index]
        t0 = time.perf_counter()
        results: dict[bytes, Loaded | OSError | CorruptBlockError] = {}
        if wanted:
            try:
                found = await asyncio.wrap_future(self.readers.submit(self._read_files, wanted))
            except ReadersStalled as exc:
                found = [exc] * len(wanted)
            results = dict(zip((k for k, _ in wanted), found, strict=True))
        elapsed = time.perf_counter() - t0
        out: list[memoryview | None] = []
        vanished = False
        for key in keys:
            result = results.get(key)
            if result is None:  # not in the index when asked
                self.stats.misses += 1
                out.append(None)
            elif isinstance(result, Loaded):
                with self._lock:
                    self.policy.touch(key)
                    self.ledger.touch(key)
                    self.life.accessed(key)
                self.stats.hits += 1
                self.stats.metadata_bytes += HEADER_SIZE
                self.stats.reads += 1
                self.stats.bytes_read += result.stored  # the record as stored (encoded)
                out.append(result.payload)
            elif isinstance(result, FileNotFoundError):
                self._forget(key)
                self.stats.misses += 1
                out.append(None)
                vanished = True
            elif isinstance(result, CorruptBlockError):
                logger.warning("disk cache: %s is unusable (%s); deleted", self.path_of(key).name, result)
                self._forget(key)
                unlink(self.path_of(key))
                if isinstance(result, UndecodableBlockError):
                    self.stats.undecodable += 1
                else:
                    self.stats.corrupt += 1
                self.stats.misses += 1
                out.append(None)
            else:
                self._error("read", result)
                out.append(None)
        self.stats.read_time_s += elapsed
        if vanished:  # a file gone from under the index: maybe the whole folder
            self.check_folder()
        return out

    def _read_files(self, items: Sequence[tuple[bytes, memoryview | None]]
                    ) -> list[Loaded | OSError | CorruptBlockError]:
        """Read and check the files of ``items`` (key, destination or None): `disk_files.read_files`
        on a reader thread. No index or stats here."""
        return read_files(self.fmt, self.dir, items)

    async def write(self, key: bytes, payload: bytes | memoryview, owner: str = UNKNOWN,
                    executor: Executor | None = None) -> bool:
        """Store a block atomically for ``owner``; True if it is on disk afterwards (False also for
        an owner whose disk quota is 0). The block is encoded with the tier's codec, and the file
        written, synced and renamed, by one call on a worker thread of ``executor`` (default: the
        loop's), header and payload without joining them."""
        if memoryview(payload).nbytes != self.fmt.payload_size:  # before reserving: must not leak a slot
            raise ValueError(f"payload is {memoryview(payload).nbytes} bytes, the block format says "
                             f"{self.fmt.payload_size}")
        size = self.record_size
        with self._lock:
            if key in self._index:
                self.policy.touch(key)
                self.ledger.touch(key)
                return True
            if not self.ledger.admits(owner):
                return False
            while self._full(size) or self.ledger.at_quota(owner):
                if not self._index:  # every slot is taken by writes in flight
                    self.stats.dropped += 1
                    return False
                self._drop(pick_victim(self.policy, self.ledger, owner))  # type: ignore[arg-type]
            self._reserve(size)
        final = self.path_of(key)
        tmp = temp_path(self.dir, key)
        t0 = time.perf_counter()
        try:
            await write_record_async(tmp, final, self.fmt, key, payload, self.codec, executor=executor)
        except BaseException as exc:  # a failed write, or a cancellation: the slot must not leak
            unlink(tmp)
            with self._lock:
                self._reserve(size, -1)
            if not isinstance(exc, OSError):
                raise
            self._error("write", exc)
            return False
        elapsed = time.perf_counter() - t0
        with self._lock:
            self._reserve(size, -1)
            if key in self._index:  # a concurrent write of the same block ended first: same bytes
                self.policy.touch(key)
                return True
            self._add(key, size)
            self.policy.insert(key)
            self.ledger.add(key, owner)
            self.life.inserted(key)
            self.events.stored(key)
        self.stats.puts += 1
        self.stats.metadata_bytes += HEADER_SIZE
        self.stats.writes += 1
        self.stats.write_time_s += elapsed
        self.stats.bytes_written += size  # the record as stored (encoded)
        return True

    def _error(self, op: str, exc: OSError) -> None:
        self.stats.errors += 1
        kind = f"{op}:{exc.errno}"
        if kind not in self._logged:  # once per kind: a full disk must not flood the log
            self._logged.add(kind)
            logger.error("disk cache %s failed in %s: %s (further errors of this kind are only counted)",
                         op, self.dir, exc.strerror or exc)
        if exc.errno == errno.ENOENT:  # the folder itself may be gone: recreate it for the next write
            self.check_folder()

    # ---- health (any thread) ------------------------------------------------------------------
    def describe(self) -> dict[str, Any]:
        problem = self.health()  # (it may recover the folder)
        return {"quota": self.ledger.snapshot(), "path": str(self.dir), "codec": self.codec, "healthy": problem is None,
                "unhealthy_reason": problem, "load_timeout_s": self.load_timeout_s,
                "stuck_reads": self.readers.stuck}

    def health(self) -> str | None:
        """Why the tier cannot serve now — its folder is gone and cannot be recreated, or every
        reader thread is stuck — or None. Checks the folder (and recovers it) on the way."""
        problem = self.check_folder()
        stuck = self.readers.stuck
        if problem is None and stuck >= self.readers.max_threads:
            problem = f"all {stuck} reader threads are stuck in reads past the {self.load_timeout_s:g} s deadline"
        return problem

    def note_stall(self, blocks: int) -> None:
        """A read batch of ``blocks`` ran past the deadline (the chain gave up waiting for it)."""
        self.stats.timeouts += blocks
        now = time.monotonic()
        if now - self._stall_logged >= STALL_LOG_EVERY_S:  # a hung disk must not flood the log
            self._stall_logged = now
            logger.warning("disk cache reads in %s take over %g s; requests recompute instead (loads past the "
                           "deadline so far: %d blocks)", self.dir, self.load_timeout_s, self.stats.timeouts)
