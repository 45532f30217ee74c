"""The state a `TierChain` keeps, and the lookups every part of it shares: which tiers are
attached (by role: cache.tiers.base) and which store holds a block."""

from __future__ import annotations

import asyncio
import os
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

from cache.telemetry import OpTimes
from cache.tiers.ioloop import IOLoop

# How host blocks reach the disk tier: "on_evict" writes a block when it leaves host memory;
# "behind" also writes host blocks in the background, oldest first, so a crash (SIGKILL, OOM kill,
# power cut) loses only the blocks of the last moments, and evicting them later costs no write;
# "idle" writes the same in the background, but only on CPU time nobody else wants: while steps
# keep every core busy it degrades to "on_evict" (docs/tiers.md, "Crash loss").
PERSIST_MODES = ("on_evict", "behind", "idle")
# Which blocks go below host memory: "always" every block; "second_use" only a block that was
# used again (a later request's prefix hit it, or it was computed again after being dropped).
ADMIT_MODES = ("always", "second_use")
# Keys remembered per set (reused blocks; blocks dropped unwritten): enough for several host
# tiers' worth of blocks, at well under 100 bytes each.
_REMEMBERED = 1 << 16



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
    persisted_behind: int = 0  # host and computed device blocks written to disk by persist = "behind" / "idle"
    not_admitted: int = 0  # admit = "second_use": blocks that left host memory unused again, not written
    readmitted: int = 0  # ... and blocks computed again after that, so admitted from then on



@dataclass(slots=True)
class JobTimes:
    """How a prefetch went: issue to release, time in tier I/O, time in remote existence checks."""

    issue_to_done_s: float = 0.0
    io_s: float = 0.0
    exists_s: float = 0.0
    blocks: int = 0  # blocks this job's own reads delivered
    by_tier: list[tuple[str, int]] = field(default_factory=list)  # of those and the shared tier's, per tier, top down



class ChainState:
    """Attached tiers, writes and loads in flight, counters (`TierChain` is the whole)."""

    def __init__(self, *, max_pending_writes: int = 256,
                 read_parallel: int = min(4, os.cpu_count() or 1), persist: str = "on_evict",
                 admit: str = "always", behind_delay_s: float = 0.0) -> None:
        if persist not in PERSIST_MODES:
            raise ValueError(f"persist must be one of {', '.join(PERSIST_MODES)}, got {persist!r}")
        if not behind_delay_s >= 0.0:
            raise ValueError(f"behind_delay_s must be 0 or more seconds, got {behind_delay_s!r}")
        if admit not in ADMIT_MODES:
            raise ValueError(f"admit must be one of {', '.join(ADMIT_MODES)}, got {admit!r}")
        self.memory: Any = None  # the `memory` tier (host slots), or None
        self.stores: list[Any] = []  # the `store` tiers (local, indexed stores), top down
        self.shared: Any = None  # the `shared` tier (a store other replicas reach), or None
        self.max_pending_writes = max_pending_writes
        self.persist = persist
        # persist = "behind": while steps run back to back, a block's background write waits up
        # to this long (a write costs the steps CPU time; an idle moment writes it at once)
        self.behind_delay_s = behind_delay_s
        self.admit = admit
        self.stats = ChainStats()
        # admit = "second_use": blocks used again (admitted), and blocks dropped unwritten (a
        # second computation admits them); oldest first, bounded
        self._reused: OrderedDict[bytes, None] = OrderedDict()
        self._dropped: OrderedDict[bytes, None] = OrderedDict()
        # Store writes in flight, key -> the payload being written: the block stays readable from
        # here until every store it goes to has indexed it (the I/O thread indexes, then forgets
        # it); `_writing_to` names those stores
        self._writing: dict[bytes, bytes | memoryview] = {}
        self._writing_to: dict[bytes, set[str]] = {}
        # background writes (persist = "behind"/"idle") in flight, key -> how many: their bytes are
        # copied on a writer thread, so a delete must wait for them to land and delete again
        self._persisting: dict[bytes, int] = {}
        # blocks that may not be on disk yet, oldest first (persist = "behind" writes them), key ->
        # (source, when first noted by `_clock`): host blocks (source None: copied from their
        # slot) and computed device blocks (source (copy, owner))
        self._unpersisted: OrderedDict[bytes, tuple[tuple[Callable[[], bytes | None], str] | None, float]] = \
            OrderedDict()
        self._clock: Callable[[], float] = time.monotonic
        # torn device copies: (key, source, when first noted)
        self._retry: queue.SimpleQueue[tuple[bytes, Any, float]] = queue.SimpleQueue()
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
        # recently written to remote, key -> owner (step loop), and the writes not yet answered
        # (key -> owner; written by the step loop, cleared by the I/O thread, under `_write_lock`)
        self._remote_sent: OrderedDict[bytes, str] = OrderedDict()
        self._remote_flight: dict[bytes, str] = {}
        # issue-to-done vs transfer time per kind of operation (gap metric 3)
        self.ops = {"prefetch": OpTimes()}  # and per tier: <store>_read, <store>_write, <shared>_put
        self.finished_jobs: dict[Hashable, JobTimes] = {}  # what poll() released, for the engine to take

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

    def on_lower_tier(self, key: bytes) -> bool:
        """Whether the block can be promoted without a read: in host, staged, or being written."""
        return (self.memory is not None and key in self.memory) or key in self._staged or key in self._writing

    def write_in_flight(self, key: bytes) -> bool:
        """Whether a write of the block to a store may still land: an eviction's or a background one."""
        return key in self._writing or key in self._persisting

    def tier(self, name: str) -> Any:
        """The attached tier called ``name``, or None."""
        return next((t for t in self.tiers if t.name == name), None)

    def admits(self, key: bytes) -> bool:
        """Whether ``key`` may be written below host memory (``admit``)."""
        return self.admit == "always" or key in self._reused

    def note_reuse(self, key: bytes) -> None:
        """A request reused ``key`` (a prefix hit): from now on it is admitted below host."""
        _remember(self._reused, key)

    def _seen_again(self, key: bytes) -> None:
        """``key`` was computed or demoted: a block dropped unwritten before is admitted now."""
        if self.admit != "always" and key in self._dropped:
            del self._dropped[key]
            self.stats.readmitted += 1
            _remember(self._reused, key)

    def _not_admitted(self, key: bytes) -> None:
        """``key`` left host memory without being used again: dropped, remembered as seen."""
        self.stats.not_admitted += 1
        _remember(self._dropped, key)

    @property
    def writes_through(self) -> bool:
        """Whether freshly computed blocks go to the shared tier at once (vs when leaving host)."""
        return self.shared is not None and self.shared.write_mode == "through"


def _remember(keys: OrderedDict[bytes, None], key: bytes) -> None:
    keys[key] = None
    keys.move_to_end(key)
    if len(keys) > _REMEMBERED:
        keys.popitem(last=False)


def _asdict(stats: ChainStats) -> dict[str, Any]:
    return {name: getattr(stats, name) for name in stats.__slots__}  # type: ignore[attr-defined]
