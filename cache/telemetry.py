"""Cheap measurements for the hot path: fixed-bucket histograms, block lives, tier-op timings.

Each object has one writer (the step loop, or a tier's I/O loop) and no lock: `observe` is a
bisect and three additions. A reader on another thread may see a count one update behind, which
is fine for metrics. The figures feed `/admin/metrics` (JSON) and `/metrics` (Prometheus); what
each one means is in docs/metrics.md.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from typing import Any


def _geometric(lo: float, hi: float, factor: float) -> tuple[float, ...]:
    out = [lo]
    while out[-1] * factor <= hi * (1 + 1e-9):
        out.append(out[-1] * factor)
    return tuple(float(f"{v:.6g}") for v in out)


SECONDS = _geometric(1e-6, 120.0, 2.0)  # 1 µs .. ~2 min
COUNTS = _geometric(1, 1 << 20, 2.0)  # 1 .. 1 Mi (batch sizes, reuse distances)
BYTES = _geometric(64, 1 << 30, 4.0)  # 64 B .. 1 GiB
USES = (0.0, *COUNTS)  # how often a block was hit, 0 included
RATIOS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)


class Histogram:
    """Counts per bucket (upper bounds ``bounds``, plus one overflow bucket), sum and count."""

    __slots__ = ("bounds", "counts", "count", "sum")

    def __init__(self, bounds: Sequence[float] = SECONDS) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)
        self.count = 0
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.count += 1
        self.sum += value

    def quantile(self, q: float) -> float | None:
        """The q-quantile, interpolated inside its bucket (as Prometheus' histogram_quantile)."""
        if self.count == 0:
            return None
        rank = q * self.count
        seen = 0
        for i, n in enumerate(self.counts):
            if n and seen + n >= rank:
                if i == len(self.bounds):  # the overflow bucket has no upper bound
                    return self.bounds[-1]
                lo = self.bounds[i - 1] if i else 0.0
                return lo + (self.bounds[i] - lo) * max(0.0, rank - seen) / n
            seen += n
        return self.bounds[-1]

    def snapshot(self) -> dict[str, Any]:
        """``counts`` has one entry more than ``buckets``: values above the last bound."""
        return {"count": self.count, "sum": self.sum, "mean": self.sum / self.count if self.count else None,
                "p50": self.quantile(0.5), "p99": self.quantile(0.99),
                "buckets": list(self.bounds), "counts": list(self.counts)}


class BlockLife:
    """How the blocks of one tier live: reuse distance and interval on every hit, lifetime and
    uses when a block leaves.

    Reuse distance counts the tier's accesses (inserts and hits) between two uses of a block: an
    upper bound of its LRU stack distance, so a block reused at distance d survives in any LRU
    tier holding more than d blocks. ``max_tracked`` bounds the records for tiers whose removals
    KVGate does not see (the remote store expires keys itself).
    """

    __slots__ = ("_seen", "_max", "clock", "reuse_distance", "reuse_interval_s", "lifetime_s", "uses", "enabled")

    def __init__(self, max_tracked: int | None = None) -> None:
        self.enabled = True  # False: every call returns at once (to measure what tracking costs)
        self._seen: OrderedDict[Hashable, list[float]] = OrderedDict()  # key → [inserted, last use, clock, uses]
        self._max = max_tracked
        self.clock = 0
        self.reuse_distance = Histogram(USES)
        self.reuse_interval_s = Histogram(SECONDS)
        self.lifetime_s = Histogram(SECONDS)
        self.uses = Histogram(USES)  # hits a block got before it left

    def inserted(self, key: Hashable) -> None:
        if not self.enabled:
            return
        self.clock += 1
        now = time.monotonic()
        self._seen[key] = [now, now, float(self.clock), 0.0]
        if self._max is not None and len(self._seen) > self._max:
            self._seen.popitem(last=False)

    def accessed(self, key: Hashable) -> None:
        if not self.enabled:
            return
        self.clock += 1
        record = self._seen.get(key)
        if record is None:  # held before KVGate saw it (a disk index rebuilt at start, a shared store)
            self.inserted(key)
            return
        now = time.monotonic()
        self.reuse_distance.observe(self.clock - record[2] - 1)
        self.reuse_interval_s.observe(now - record[1])
        record[1], record[2] = now, float(self.clock)
        record[3] += 1
        if self._max is not None:
            self._seen.move_to_end(key)

    def removed(self, key: Hashable) -> None:
        if not self.enabled:
            return
        record = self._seen.pop(key, None)
        if record is not None:
            self.lifetime_s.observe(time.monotonic() - record[0])
            self.uses.observe(record[3])

    def __len__(self) -> int:
        return len(self._seen)

    def snapshot(self) -> dict[str, Any]:
        return {"tracked_blocks": len(self._seen), "reuse_distance": self.reuse_distance.snapshot(),
                "reuse_interval_s": self.reuse_interval_s.snapshot(), "lifetime_s": self.lifetime_s.snapshot(),
                "uses": self.uses.snapshot()}


class OpTimes:
    """Issue-to-done time of one kind of tier operation against its raw transfer time.

    Issue is when the step loop asked for it, done is when the step loop learns it finished;
    transfer is the time inside the tier call itself. The difference is the completion overhead:
    thread hops, queueing on the I/O loop, polling.
    """

    __slots__ = ("issue_to_done_s", "transfer_s")

    def __init__(self) -> None:
        self.issue_to_done_s = Histogram(SECONDS)
        self.transfer_s = Histogram(SECONDS)

    def observe(self, issue_to_done_s: float, transfer_s: float) -> None:
        self.issue_to_done_s.observe(issue_to_done_s)
        self.transfer_s.observe(min(transfer_s, issue_to_done_s))

    def snapshot(self) -> dict[str, Any]:
        total, raw = self.issue_to_done_s.sum, self.transfer_s.sum
        return {"ops": self.issue_to_done_s.count, "issue_to_done_s": self.issue_to_done_s.snapshot(),
                "transfer_s": self.transfer_s.snapshot(),
                "overhead_share": (total - raw) / total if total > 0 else None}


class AccessPattern:
    """What one tier's operations look like: blocks per batch and bytes per batch, per op kind."""

    __slots__ = ("batch_blocks", "op_bytes", "ops", "blocks")

    def __init__(self) -> None:
        self.batch_blocks: dict[str, Histogram] = {}
        self.op_bytes: dict[str, Histogram] = {}
        self.ops: dict[str, int] = {}
        self.blocks: dict[str, int] = {}

    def observe(self, kind: str, blocks: int, nbytes: int) -> None:
        if kind not in self.ops:
            self.batch_blocks[kind], self.op_bytes[kind] = Histogram(COUNTS), Histogram(BYTES)
            self.ops[kind] = self.blocks[kind] = 0
        self.batch_blocks[kind].observe(blocks)
        self.op_bytes[kind].observe(nbytes)
        self.ops[kind] += 1
        self.blocks[kind] += blocks

    def snapshot(self) -> dict[str, Any]:
        reads = self.blocks.get("get", 0)
        writes = self.blocks.get("put", 0)
        return {"ops": dict(self.ops), "blocks": dict(self.blocks),
                "read_share": reads / (reads + writes) if reads + writes else None,
                "batch_blocks": {k: h.snapshot() for k, h in self.batch_blocks.items()},
                "op_bytes": {k: h.snapshot() for k, h in self.op_bytes.items()}}
