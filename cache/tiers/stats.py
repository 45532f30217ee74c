"""Per-tier counters (they only grow) and a running estimate of a tier's load speed."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(slots=True)
class TierStats:
    hits: int = 0
    misses: int = 0
    puts: int = 0
    evictions: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    reads: int = 0
    writes: int = 0
    read_time_s: float = 0.0
    write_time_s: float = 0.0
    errors: int = 0
    corrupt: int = 0
    dropped: int = 0
    metadata_bytes: int = 0  # keys, record headers, existence checks: bytes that describe blocks
    handovers: int = 0  # blocks moved to or from the device by trading rows: no bytes copied (host on CPU)

    def snapshot(self) -> dict[str, float]:
        return asdict(self)


class RateEstimate:
    """Exponentially weighted bytes per second and per-operation latency of a tier's loads."""

    def __init__(self, bytes_per_s: float, latency_s: float, weight: float = 0.2) -> None:
        self.bytes_per_s = bytes_per_s
        self.latency_s = latency_s
        self.weight = weight
        self.samples = 0

    def observe(self, nbytes: int, seconds: float, ops: int = 1) -> None:
        if seconds <= 0 or nbytes <= 0:
            return
        w = self.weight if self.samples else 1.0
        self.bytes_per_s += w * (nbytes / seconds - self.bytes_per_s)
        self.latency_s += w * (seconds / max(1, ops) - self.latency_s)
        self.samples += 1

    def predict_s(self, nbytes: int, ops: int) -> float:
        """Seconds to load ``nbytes`` in ``ops`` operations issued together."""
        return self.latency_s + nbytes / max(self.bytes_per_s, 1.0)
