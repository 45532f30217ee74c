"""DiskIndex: which blocks a disk tier's folder holds, kept in memory and rebuilt from the folder.

The index is the folder's block files (`disk_files.scan`: names and sizes, no metadata file to
get out of step), in eviction order by modification time, each block with its owner for tenant
quotas and its record's size: capacity is counted in bytes of records as stored (encoded), so a
tier whose codec halves a block holds twice the blocks; ``capacity_blocks`` is what the capacity
holds of blocks of the tier's own codec. Blocks outlive restarts: the index is rebuilt when the tier starts. It is read by the
step loop and changed by the I/O loop, under one lock. A folder that vanished under it is made
again (its blocks counted lost), and another folder found in its place is indexed afresh.

Blocks named by ``protected`` (pins of the cache control API, engine/cache_control.py) are passed
over by eviction while another block can go; only a disk full of them evicts one after all.
"""

from __future__ import annotations

import errno
import logging
import threading
from collections.abc import Collection, Hashable
from pathlib import Path

from cache.events import NO_EVENTS, MediumEvents, NoEvents
from cache.quota import UNKNOWN
from cache.telemetry import BlockLife
from cache.tiers.codec import BlockFormat
from cache.tiers.disk_files import HASH_HEX, SUFFIX, block_path, scan, unlink
from cache.tiers.folders import identity
from cache.tiers.kv_codec import CODECS, check_codec
from cache.tiers.policy import ProtectedPolicy, ProtectingLedger, make_policy
from cache.tiers.stats import TierStats

logger = logging.getLogger(__name__)


class DiskIndex:
    """The index half of `DiskTier`: its folder, the blocks in it, their eviction order and owners."""

    def __init__(self, path: str | Path, capacity_bytes: int, fmt: BlockFormat, policy: str = "lru",
                 codec: str = "none") -> None:
        self.fmt = fmt
        self.codec = check_codec(codec)  # how blocks are written; any codec is read
        self.record_size = fmt.record_size_of(codec)  # bytes of one record written here
        self.root = Path(path).expanduser()
        self.dir = self.root / fmt.fingerprint.hex()[:16]
        self.capacity_bytes = capacity_bytes
        self.capacity_blocks = capacity_bytes // self.record_size
        if self.capacity_blocks <= 0:
            raise ValueError(f"disk tier of {capacity_bytes} bytes holds no block of {self.record_size} bytes")
        # keys eviction passes over while it can (pins; see the module docstring): set by the cache control
        self.protected: Collection[bytes] = frozenset()
        self.policy = ProtectedPolicy(make_policy(policy, self.capacity_blocks), self._is_protected, strict=False)
        self.policy_name = policy
        self.stats = TierStats()
        self.life = BlockLife()  # written on the I/O loop (reads, writes, evictions)
        self.events: MediumEvents | NoEvents = NO_EVENTS  # KV events (cache.events), where blocks come and go
        self._lock = threading.Lock()  # the index is read by the step loop, changed by the I/O loop
        self._index: dict[bytes, int] = {}  # block → bytes of its record
        self._bytes = 0  # of the records indexed
        # who wrote each block (files found at start: unknown); tenants' disk quotas
        self.ledger = ProtectingLedger(self.capacity_blocks, self._is_protected)
        self._reserved = 0  # slots held by writes in flight
        self._reserved_bytes = 0  # their records' bytes
        self._folder_problem: str | None = None  # why the folder cannot be used now (None: it can)
        self._folder_lock = threading.Lock()  # one thread at a time recovers a vanished folder
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise OSError(f"cannot create the disk cache folder {self.dir}: {exc.strerror}; pass a writable "
                          "[cache.disk] path (or --disk-cache PATH), or --disk-cache off") from exc
        self._folder_id = identity(self.dir)  # the folder indexed; another one there means a new index
        if self._folder_id is None:
            raise OSError(f"the disk cache folder {self.dir} is not a folder (a link or a file)")
        self.rebuilt = self._rebuild()

    # ---- lookups (any thread) ----------------------------------------------------------------
    def _is_protected(self, key: Hashable) -> bool:
        return key in self.protected  # type: ignore[operator]

    def keys_of(self, owner: str) -> list[bytes]:
        """The blocks ``owner`` wrote here (files found at start have no known owner)."""
        with self._lock:
            return list(self.ledger.oldest(owner))  # type: ignore[arg-type]

    def __contains__(self, key: bytes) -> bool:
        with self._lock:
            return key in self._index

    def __len__(self) -> int:
        with self._lock:
            return len(self._index)

    def keys(self) -> list[bytes]:
        """Every block indexed now."""
        with self._lock:
            return list(self._index)

    @property
    def nbytes(self) -> int:
        return self._bytes

    def _full(self, size: int) -> bool:
        """Whether a record of ``size`` bytes more would not fit. Holds ``_lock``."""
        return (len(self._index) + self._reserved >= self.capacity_blocks
                or self._bytes + self._reserved_bytes + size > self.capacity_bytes)

    def _reserve(self, size: int, slots: int = 1) -> None:
        """Hold room for a write in flight of a ``size``-byte record (``slots=-1`` gives it back).
        Holds ``_lock``."""
        self._reserved += slots
        self._reserved_bytes += slots * size

    def path_of(self, key: bytes) -> Path:
        return block_path(self.dir, key)

    # ---- changes -----------------------------------------------------------------------------
    def _rebuild(self) -> int:
        """Index the block files in the folder, oldest first, down to capacity; how many."""
        found, corrupt = scan(self.dir, {self.fmt.record_size_of(codec) for codec in CODECS})
        self.stats.corrupt += corrupt
        for key, size in found:
            self._add(key, size)
            self.policy.insert(key)
            self.ledger.add(key, UNKNOWN)
        while len(self._index) > self.capacity_blocks or self._bytes > self.capacity_bytes:
            self._drop(self.policy.evict())  # type: ignore[arg-type]
        self.events.stored_all(list(self._index))
        if self._index:
            logger.info("disk cache: %d blocks found in %s", len(self._index), self.dir)
        return len(self._index)

    def _add(self, key: bytes, size: int) -> None:
        """Index ``key``, whose record takes ``size`` bytes. Holds ``_lock``."""
        self._index[key] = size
        self._bytes += size

    def _discard(self, key: bytes) -> None:
        """Take ``key`` out of the index (and its bytes out of the count). Holds ``_lock``."""
        self._bytes -= self._index.pop(key, 0)

    def _drop(self, key: bytes) -> None:
        """Evict ``key`` (the policy already let it go) and delete its file. Holds ``_lock``."""
        self._discard(key)
        self.ledger.remove(key)
        self.life.removed(key)
        self.events.removed(key)
        unlink(self.path_of(key))
        self.stats.evictions += 1

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
            self._discard(key)
            self.policy.remove(key)
            self.ledger.remove(key)
            self.life.removed(key)
            self.events.removed(key)
        unlink(self.path_of(key))
        return True

    def _forget(self, key: bytes) -> None:
        """Take ``key`` out of the index, leaving its file (if any) to the caller."""
        with self._lock:
            if key in self._index:
                self._discard(key)
                self.policy.remove(key)
                self.ledger.remove(key)
                self.life.removed(key)
                self.events.removed(key)

    def apply_quota(self, owner: str, tag: str, blocks: int | None) -> None:
        """At most ``blocks`` of ``owner``'s blocks here (None: no limit)."""
        self.ledger.set_limit(owner, blocks)

    # ---- the folder (any thread) -------------------------------------------------------------
    def check_folder(self) -> str | None:
        """Make sure the folder indexed is still there: recreate it when it vanished (its blocks
        are counted lost), index the one found when another took its place. Returns why the
        folder cannot be used now, or None. Cheap when nothing changed (one ``lstat``). A folder
        is known by device and inode, so one deleted and at once made again may pass for the old
        one (the inode reused): its missing files are then forgotten as they are read."""
        if self._folder_id is not None and identity(self.dir) == self._folder_id:
            return None
        with self._folder_lock:
            if self._folder_id is not None and identity(self.dir) == self._folder_id:
                return None  # another thread just recovered it
            with self._lock:
                lost = self._clear_index()
            self.stats.lost += lost
            try:
                self.dir.mkdir(parents=True, exist_ok=True)
                ident = identity(self.dir)
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
        self.events.removed_all(list(self._index))
        self._index.clear()
        self._bytes = 0
        return lost

    def check_invariants(self) -> None:
        with self._lock:
            assert len(self.policy) == len(self._index)
            assert len(self.ledger) == len(self._index)
            assert len(self._index) <= self.capacity_blocks
            assert self._bytes == sum(self._index.values()) <= self.capacity_bytes
            on_disk = {p.name[:HASH_HEX] for p in self.dir.glob("*" + SUFFIX)}  # foreign names too
            assert {k.hex() for k in self._index} <= on_disk, "index names files that do not exist"
