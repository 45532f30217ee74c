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

The folder may be hostile or broken: a block file is opened without following links and without
blocking (a named pipe must not hang a reader), and anything but a regular file is treated as
corrupt. Reads run on the tier's own `ReaderPool`: the chain gives each read batch a deadline
(``load_timeout_s``), and a read stuck past it does not take the pool. A folder that vanished is
recreated (its blocks are counted lost); while it cannot be, `health` says why.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import stat
import threading
import time
import uuid
from collections.abc import Sequence
from concurrent.futures import Executor
from pathlib import Path
from typing import Any

import aiofiles
import aiofiles.os
import numpy

from cache.quota import UNKNOWN, QuotaLedger, pick_victim
from cache.telemetry import BlockLife
from cache.tiers.base import TierTraits
from cache.tiers.codec import HEADER_SIZE, BlockFormat, CorruptBlockError, check, encode_header
from cache.tiers.iov import advance
from cache.tiers.policy import make_policy
from cache.tiers.readers import ReaderPool, ReadersStalled
from cache.tiers.stats import RateEstimate, TierStats

logger = logging.getLogger(__name__)

SUFFIX = ".kvb"
_HASH_HEX = 64
# Block files are opened so that neither a link nor a named pipe is followed or waited on.
_OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
LOAD_TIMEOUT_S = 0.5  # default deadline of one read batch (`[cache.disk] load_timeout_s`)
STALL_LOG_EVERY_S = 60.0  # at most one warning per this long about loads past the deadline


class DiskTier:
    name = "disk"
    traits = TierTraits(locality="node-ssd", lifetime="persistent", substrate="nvme-fs", shared=False, role="store")

    def __init__(self, path: str | Path, capacity_bytes: int, fmt: BlockFormat, policy: str = "lru",
                 load_timeout_s: float = LOAD_TIMEOUT_S, read_threads: int = min(4, os.cpu_count() or 1)) -> None:
        if load_timeout_s <= 0:
            raise ValueError(f"load_timeout_s must be positive, got {load_timeout_s!r}")
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
        # the deadline the chain gives each read batch; a reader thread past it no longer counts
        self.load_timeout_s = load_timeout_s
        self.readers = ReaderPool(read_threads, 4 * read_threads, load_timeout_s, name="kvgate-disk-read")
        self._stall_logged = -STALL_LOG_EVERY_S
        self._folder_problem: str | None = None  # why the folder cannot be used now (None: it can)
        self._folder_lock = threading.Lock()  # one thread at a time recovers a vanished folder
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise OSError(f"cannot create the disk cache folder {self.dir}: {exc.strerror}; pass a writable "
                          "[cache.disk] path (or --disk-cache PATH), or --disk-cache off") from exc
        self._folder_id = _identity(self.dir)  # the folder indexed; another one there means a new index
        if self._folder_id is None:
            raise OSError(f"the disk cache folder {self.dir} is not a folder (a link or a file)")
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
                info = entry.stat(follow_symlinks=False)  # a link is judged itself, never its target
            except (ValueError, OSError):
                continue
            # truncated, foreign, or no regular file (a link, a pipe, a device): never served
            if not stat.S_ISREG(info.st_mode) or info.st_size != self.fmt.record_size:
                _unlink(entry.path)
                self.stats.corrupt += 1
                continue
            entries.append((info.st_mtime, key))
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

        The files are opened, read and checked by one call on a reader thread (`_read_files` on
        `readers`): aiofiles' file objects cost three thread-pool hops per block (open, read,
        close), which on a 2-core machine took more time than the reads. The chain runs several
        such batches at once (reads release the GIL, so they overlap). Each payload is a writable
        view into the buffer its file was read into: no copy is made between the file and the
        host slot it goes to. When every reader thread is stuck the batch fails at once (counted
        as read errors): the request recomputes instead of queueing behind a hung disk.
        """
        dests = list(into) if into is not None else [None] * len(keys)
        with self._lock:
            wanted = [(key, dest) for key, dest in zip(keys, dests, strict=True) if key in self._index]
        t0 = time.perf_counter()
        results: dict[bytes, memoryview | OSError | CorruptBlockError] = {}
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
                vanished = True
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
        if vanished:  # a file gone from under the index: maybe the whole folder
            self.check_folder()
        return out

    def _read_files(self, items: Sequence[tuple[bytes, memoryview | None]]
                    ) -> list[memoryview | OSError | CorruptBlockError]:
        """Read and check the files of ``items`` (key, destination or None), each with one scattered
        read: header → its own buffer, payload → the destination (or a fresh buffer), one byte more
        → a spare buffer, so a padded file is caught. A reader thread: no index or stats here.

        Links are not followed and nothing is waited on at open (`_OPEN_FLAGS`); anything but a
        regular file — a link, a named pipe, a device — is corrupt, and never read."""
        out: list[memoryview | OSError | CorruptBlockError] = []
        size = self.fmt.payload_size
        header = memoryview(bytearray(HEADER_SIZE))
        spare = memoryview(bytearray(1))
        for key, dest in items:
            payload = dest if dest is not None else numpy.empty(size, dtype=numpy.uint8).data
            try:
                fd = os.open(self.path_of(key), _OPEN_FLAGS)
            except OSError as exc:
                out.append(CorruptBlockError("a symbolic link, not a block file") if exc.errno == errno.ELOOP else exc)
                continue
            try:
                mode = os.fstat(fd).st_mode
                if not stat.S_ISREG(mode):
                    out.append(CorruptBlockError(f"not a regular file (mode {stat.filemode(mode)})"))
                    continue
                n = _read_scattered(fd, [header, payload, spare])
            except OSError as exc:
                out.append(exc)
                continue
            finally:
                os.close(fd)
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
            if key in self._index:  # a concurrent write of the same block ended first: same bytes
                self.policy.touch(key)
                return True
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

    def touch(self, key: bytes) -> bool:
        """Mark a stored block as just used; False if the tier does not hold it."""
        with self._lock:
            if key not in self._index:
                return False
            self.policy.touch(key)
            self.ledger.touch(key)
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
        if exc.errno == errno.ENOENT:  # the folder itself may be gone: recreate it for the next write
            self.check_folder()

    # ---- health (any thread) ------------------------------------------------------------------
    def check_folder(self) -> str | None:
        """Make sure the folder indexed is still there: recreate it when it vanished (its blocks
        are counted lost), index the one found when another took its place. Returns why the
        folder cannot be used now, or None. Cheap when nothing changed (one ``lstat``). A folder
        is known by device and inode, so one deleted and at once made again may pass for the old
        one (the inode reused): its missing files are then forgotten as they are read."""
        if self._folder_id is not None and _identity(self.dir) == self._folder_id:
            return None
        with self._folder_lock:
            if self._folder_id is not None and _identity(self.dir) == self._folder_id:
                return None  # another thread just recovered it
            with self._lock:
                lost = self._clear_index()
            self.stats.lost += lost
            try:
                self.dir.mkdir(parents=True, exist_ok=True)
                ident = _identity(self.dir)
                if ident is None:
                    raise NotADirectoryError(errno.ENOTDIR, "not a folder (a link?)")
            except OSError as exc:
                problem = f"the folder {self.dir} is gone and cannot be recreated: {exc.strerror or exc}"
                if problem != self._folder_problem:
                    logger.error("disk cache: %s; %d blocks lost, loads and writes fail until it can be", problem, lost)
                self._folder_id, self._folder_problem = None, problem
                return problem
            with self._lock:
                found = self._rebuild()
            logger.warning("disk cache folder %s was gone or replaced (%d blocks lost); now in use again with %d "
                           "blocks", self.dir, lost, found)
            self._folder_id, self._folder_problem = ident, None
            return None

    def _clear_index(self) -> int:
        """Forget every block (their files went with the folder); how many. Holds ``_lock``."""
        lost = len(self._index)
        for key in self._index:
            self.policy.remove(key)
            self.ledger.remove(key)
            self.life.removed(key)
        self._index.clear()
        return lost

    def apply_quota(self, owner: str, tag: str, blocks: int | None) -> None:
        """At most ``blocks`` of ``owner``'s blocks here (None: no limit)."""
        self.ledger.set_limit(owner, blocks)

    def describe(self) -> dict[str, Any]:
        problem = self.health()  # (it may recover the folder)
        return {"quota": self.ledger.snapshot(), "path": str(self.dir), "healthy": problem is None,
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


_write_file_async = aiofiles.os.wrap(_write_file)


def _identity(path: Path) -> tuple[int, int] | None:
    """(device, inode) of the folder at ``path``, None if there is none (a link is not one)."""
    try:
        info = os.lstat(path)
    except OSError:
        return None
    return (info.st_dev, info.st_ino) if stat.S_ISDIR(info.st_mode) else None


def _unlink(path: str | Path) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
