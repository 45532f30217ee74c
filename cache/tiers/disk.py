"""DiskTier: one file per KV block under a folder, written atomically, indexed in memory.

    <path>/<first 16 hex digits of the model fingerprint>/<block hash hex>.kvb

Files hold `codec` records (header + payload). Reads and writes are coroutines run on the chain's
I/O event loop (`aiofiles`), never on the step loop. A write goes to a temporary file, is
fsync'ed and renamed over the final name, so a crash leaves either the whole block or nothing;
that file work is one call on a worker thread (the chain's writer threads: writes are
demotions nobody waits for, so they run below the step loop's CPU priority).
The index is rebuilt from the folder when the tier starts (blocks outlive restarts), oldest
modification time first as eviction order; leftover temporary files are removed. Capacity is
counted in blocks (``capacity_bytes`` // record size). A corrupt, truncated or foreign file is a
miss: it is deleted and counted. I/O errors (read-only folder, disk full) are counted and logged
once per kind; the block is simply not stored.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections.abc import Sequence
from concurrent.futures import Executor
from pathlib import Path

import aiofiles
import aiofiles.os
import numpy

from cache.quota import UNKNOWN, QuotaLedger, pick_victim
from cache.telemetry import BlockLife
from cache.tiers.codec import HEADER_SIZE, BlockFormat, CorruptBlockError, check, encode_header
from cache.tiers.iov import advance
from cache.tiers.policy import make_policy
from cache.tiers.stats import RateEstimate, TierStats

logger = logging.getLogger(__name__)

SUFFIX = ".kvb"
_HASH_HEX = 64


class DiskTier:
    name = "disk"

    def __init__(self, path: str | Path, capacity_bytes: int, fmt: BlockFormat, policy: str = "lru") -> None:
        self.fmt = fmt
        self.root = Path(path).expanduser()
        self.dir = self.root / fmt.fingerprint.hex()[:16]
        self.capacity_blocks = capacity_bytes // fmt.record_size
        if self.capacity_blocks <= 0:
            raise ValueError(f"disk tier of {capacity_bytes} bytes holds no block of {fmt.record_size} bytes")
        self.policy = make_policy(policy, self.capacity_blocks)
        self.policy_name = policy
        self.stats = TierStats()
        # observed per prefetch batch by the chain (reads overlap, so one read's time says little)
        self.rate = RateEstimate(bytes_per_s=500e6, latency_s=2e-3)
        self.life = BlockLife()  # written on the I/O loop (reads, writes, evictions)
        self._lock = threading.Lock()  # the index is read by the step loop, changed by the I/O loop
        self._index: set[bytes] = set()
        # who wrote each block (files found at start: unknown); tenants' disk quotas
        self.ledger = QuotaLedger(self.capacity_blocks)
        self._reserved = 0
        self._logged: set[str] = set()
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise OSError(f"cannot create the disk cache folder {self.dir}: {exc.strerror}; pass a writable "
                          "[cache.disk] path (or --disk-cache PATH), or --disk-cache off") from exc
        self.rebuilt = self._rebuild()

    # ---- index (any thread) -----------------------------------------------------------------
    def __contains__(self, key: bytes) -> bool:
        with self._lock:
            return key in self._index

    def __len__(self) -> int:
        with self._lock:
            return len(self._index)

    @property
    def nbytes(self) -> int:
        return len(self) * self.fmt.record_size

    def path_of(self, key: bytes) -> Path:
        return self.dir / (key.hex() + SUFFIX)

    def _rebuild(self) -> int:
        entries: list[tuple[float, bytes]] = []
        for entry in os.scandir(self.dir):
            name = entry.name
            if name.endswith(".tmp"):
                _unlink(entry.path)
                continue
            if not name.endswith(SUFFIX) or len(name) != _HASH_HEX + len(SUFFIX):
                continue
            try:
                key = bytes.fromhex(name[:_HASH_HEX])
                stat = entry.stat()
            except (ValueError, OSError):
                continue
            if stat.st_size != self.fmt.record_size:  # truncated or foreign: never served
                _unlink(entry.path)
                self.stats.corrupt += 1
                continue
            entries.append((stat.st_mtime, key))
        entries.sort()
        for _, key in entries:
            self._index.add(key)
            self.policy.insert(key)
            self.ledger.add(key, UNKNOWN)
        while len(self._index) > self.capacity_blocks:
            self._drop(self.policy.evict())  # type: ignore[arg-type]
        if self._index:
            logger.info("disk cache: %d blocks found in %s", len(self._index), self.dir)
        return len(self._index)

    def _drop(self, key: bytes) -> None:
        self._index.discard(key)
        self.ledger.remove(key)
        self.life.removed(key)
        _unlink(self.path_of(key))
        self.stats.evictions += 1

    # ---- I/O (the chain's I/O loop) -----------------------------------------------------------
    async def read(self, key: bytes) -> memoryview | None:
        """The block's payload, or None (missing, unreadable, or corrupt: then deleted)."""
        return (await self.read_many([key]))[0]

    async def read_many(self, keys: Sequence[bytes], into: Sequence[memoryview | None] | None = None
                        ) -> list[memoryview | None]:
        """Payloads of ``keys`` in order (None: missing, unreadable, or corrupt: then deleted).
        ``into`` may give, per key, a writable buffer of the payload's size (a reserved host slot)
        that the payload is read straight into; the result is then a view of it.

        The files are opened, read and checked by one call on a worker thread (``aiofiles.os.wrap``
        of `_read_files`): aiofiles' file objects cost three thread-pool hops per block (open,
        read, close), which on a 2-core machine took more time than the reads. The chain runs
        several such batches at once (reads release the GIL, so they overlap). Each payload is a
        writable view into the buffer its file was read into: no copy is made between the file
        and the host slot it goes to.
        """
        dests = list(into) if into is not None else [None] * len(keys)
        with self._lock:
            wanted = [(key, dest) for key, dest in zip(keys, dests, strict=True) if key in self._index]
        t0 = time.perf_counter()
        results = dict(zip((k for k, _ in wanted), await _read_files_async(self, wanted), strict=True)) if wanted else {}
        elapsed = time.perf_counter() - t0
        out: list[memoryview | None] = []
        for key in keys:
            result = results.get(key)
            if result is None:  # not in the index when asked
                self.stats.misses += 1
                out.append(None)
            elif isinstance(result, memoryview):
                with self._lock:
                    self.policy.touch(key)
                    self.ledger.touch(key)
                    self.life.accessed(key)
                self.stats.hits += 1
                self.stats.metadata_bytes += HEADER_SIZE
                self.stats.reads += 1
                self.stats.bytes_read += HEADER_SIZE + result.nbytes
                out.append(result)
            elif isinstance(result, FileNotFoundError):
                self._forget(key)
                self.stats.misses += 1
                out.append(None)
            elif isinstance(result, CorruptBlockError):
                logger.warning("disk cache: %s is unusable (%s); deleted", self.path_of(key).name, result)
                self._forget(key)
                _unlink(self.path_of(key))
                self.stats.corrupt += 1
                self.stats.misses += 1
                out.append(None)
            else:
                self._error("read", result)
                out.append(None)
        self.stats.read_time_s += elapsed
        return out

    def _read_files(self, items: Sequence[tuple[bytes, memoryview | None]]
                    ) -> list[memoryview | OSError | CorruptBlockError]:
        """Read and check the files of ``items`` (key, destination or None), each with one scattered
        read: header → its own buffer, payload → the destination (or a fresh buffer), one byte more
        → a spare buffer, so a padded file is caught. A worker thread: no index or stats here."""
        out: list[memoryview | OSError | CorruptBlockError] = []
        size = self.fmt.payload_size
        header = memoryview(bytearray(HEADER_SIZE))
        spare = memoryview(bytearray(1))
        for key, dest in items:
            payload = dest if dest is not None else numpy.empty(size, dtype=numpy.uint8).data
            try:
                fd = os.open(self.path_of(key), os.O_RDONLY)
                try:
                    n = _read_scattered(fd, [header, payload, spare])
                finally:
                    os.close(fd)
            except OSError as exc:
                out.append(exc)
                continue
            try:
                if n < HEADER_SIZE:
                    raise CorruptBlockError(f"record is {n} bytes, shorter than the {HEADER_SIZE}-byte header")
                out.append(check(self.fmt, key, header, payload, n - HEADER_SIZE))
            except CorruptBlockError as exc:
                out.append(exc)
        return out

    async def write(self, key: bytes, payload: bytes | memoryview, owner: str = UNKNOWN,
                    executor: Executor | None = None) -> bool:
        """Store a block atomically for ``owner``; True if it is on disk afterwards (False also for
        an owner whose disk quota is 0). The file is written, synced and renamed by one call on a
        worker thread of ``executor`` (default: the loop's), header and payload without joining them."""
        header = encode_header(self.fmt, key, payload)  # before reserving: a bad payload must not leak a slot
        with self._lock:
            if key in self._index:
                self.policy.touch(key)
                self.ledger.touch(key)
                return True
            if not self.ledger.admits(owner):
                return False
            while len(self._index) + self._reserved >= self.capacity_blocks or self.ledger.at_quota(owner):
                if not self._index:  # every slot is taken by writes in flight
                    self.stats.dropped += 1
                    return False
                self._drop(pick_victim(self.policy, self.ledger, owner))  # type: ignore[arg-type]
            self._reserved += 1
        final = self.path_of(key)
        tmp = self.dir / f".{key.hex()[:16]}.{uuid.uuid4().hex[:8]}.tmp"
        t0 = time.perf_counter()
        try:
            await _write_file_async(tmp, final, header, payload, executor=executor)
        except OSError as exc:
            _unlink(tmp)
            with self._lock:
                self._reserved -= 1
            self._error("write", exc)
            return False
        elapsed = time.perf_counter() - t0
        with self._lock:
            self._reserved -= 1
            self._index.add(key)
            self.policy.insert(key)
            self.ledger.add(key, owner)
            self.life.inserted(key)
        self.stats.puts += 1
        self.stats.metadata_bytes += HEADER_SIZE
        self.stats.writes += 1
        self.stats.write_time_s += elapsed
        self.stats.bytes_written += self.fmt.record_size
        return True

    def delete(self, key: bytes) -> bool:
        with self._lock:
            if key not in self._index:
                return False
            self._index.discard(key)
            self.policy.remove(key)
            self.ledger.remove(key)
            self.life.removed(key)
        _unlink(self.path_of(key))
        return True

    def _forget(self, key: bytes) -> None:
        with self._lock:
            if key in self._index:
                self._index.discard(key)
                self.policy.remove(key)
                self.ledger.remove(key)
                self.life.removed(key)

    def _error(self, op: str, exc: OSError) -> None:
        self.stats.errors += 1
        kind = f"{op}:{exc.errno}"
        if kind not in self._logged:  # once per kind: a full disk must not flood the log
            self._logged.add(kind)
            logger.error("disk cache %s failed in %s: %s (further errors of this kind are only counted)",
                         op, self.dir, exc.strerror or exc)

    def check_invariants(self) -> None:
        with self._lock:
            assert len(self.policy) == len(self._index)
            assert len(self.ledger) == len(self._index)
            assert len(self._index) <= self.capacity_blocks
            on_disk = {p.name[:_HASH_HEX] for p in self.dir.glob("*" + SUFFIX)}  # foreign names too
            assert {k.hex() for k in self._index} <= on_disk, "index names files that do not exist"


def _write_file(tmp: Path, final: Path, header: bytes, payload: bytes | memoryview) -> None:
    """Write a record to ``tmp`` (header, then payload, gathered), fsync it, rename it to ``final``."""
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        bufs = [memoryview(header), memoryview(payload).cast("B")]
        while bufs:
            bufs = advance(bufs, os.writev(fd, bufs))
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, final)


def _read_scattered(fd: int, bufs: list[memoryview]) -> int:
    """Fill ``bufs`` in order from ``fd`` until they are full or the file ends; bytes read."""
    total = 0
    while bufs:
        n = os.readv(fd, bufs)
        if n == 0:
            break
        total += n
        bufs = advance(bufs, n)
    return total


_read_files_async = aiofiles.os.wrap(DiskTier._read_files)
_write_file_async = aiofiles.os.wrap(_write_file)


def _unlink(path: str | Path) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
