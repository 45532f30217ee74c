"""Per-tier counters (they only grow) and a running estimate of a tier's load speed."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
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
    timeouts: int = 0  # blocks whose load ran past the tier's deadline (the request recomputed them)
    lost: int = 0  # blocks whose files vanished with their folder
    undecodable: int = 0  # records of a codec this reader does not know: misses, deleted
    unauthentic: int = 0  # shared-store records whose MAC fails (planted, altered, another secret): misses, deleted

    def snapshot(self) -> dict[str, float]:
        return asdict(self)


class RateEstimate:
    """Bytes per second and per-operation latency of a tier's loads, as a weighted geometric mean
    of recent samples: each sample's weight halves every ``half_life_s``, and the prior counts as
    one faint sample (``prior_weight``) that never ages.

    A stall is one sample among others, and it ages out in seconds even when no load follows it —
    which matters, since a slow estimate steers requests to recompute, and then nothing would
    correct it. Geometric, because speeds span orders of magnitude: an arithmetic mean would let
    one ten-second stall outweigh a hundred two-millisecond loads."""

    def __init__(self, bytes_per_s: float, latency_s: float, half_life_s: float = 1.0,
                 prior_weight: float = 0.25, clock: Callable[[], float] = time.monotonic) -> None:
        self.half_life_s = half_life_s
        self.prior_weight = prior_weight
        self.samples = 0  # loads observed, ever
        self.last_sample: float | None = None  # `clock` time of the latest one
        self._clock = clock
        self._prior = (bytes_per_s, latency_s)
        self._weight = 0.0  # of the samples, aged to `last_sample`
        self._logs = (0.0, 0.0)  # weighted sums of log(bytes per s), log(latency), aged likewise

    @property
    def bytes_per_s(self) -> float:
        return self._estimate(0)

    @bytes_per_s.setter
    def bytes_per_s(self, value: float) -> None:
        self._set(0, value)

    @property
    def latency_s(self) -> float:
        return self._estimate(1)

    @latency_s.setter
    def latency_s(self, value: float) -> None:
        self._set(1, value)

    def _set(self, i: int, value: float) -> None:
        """Replace the prior of one quantity and forget the samples (tests and benchmarks pin it)."""
        prior = list(self._prior)
        prior[i] = value
        self._prior = (prior[0], prior[1])
        self._weight, self._logs = 0.0, (0.0, 0.0)

    def _aged(self, now: float) -> float:
        if self.last_sample is None:
            return 0.0
        return 0.5 ** (max(0.0, now - self.last_sample) / self.half_life_s)

    def _estimate(self, i: int) -> float:
        prior = self._prior[i]
        if not self._weight:
            return prior
        aged = self._aged(self._clock())
        weight = self._weight * aged
        total = self._logs[i] * aged + self.prior_weight * math.log(max(prior, 1e-12))
        return math.exp(total / (weight + self.prior_weight))

    def observe(self, nbytes: int, seconds: float, ops: int = 1) -> None:
        if seconds <= 0 or nbytes <= 0:
            return
        now = self._clock()
        aged = self._aged(now)
        rate, latency = math.log(nbytes / seconds), math.log(seconds / max(1, ops))
        self._weight = self._weight * aged + 1.0
        self._logs = (self._logs[0] * aged + rate, self._logs[1] * aged + latency)
        self.last_sample = now
        self.samples += 1

    def age_s(self) -> float | None:
        """Seconds since the latest sample (None: none yet)."""
        return None if self.last_sample is None else self._clock() - self.last_sample

    def predict_s(self, nbytes: int, ops: int) -> float:
        """Seconds to load ``nbytes`` in ``ops`` operations issued together."""
        return self.latency_s + nbytes / max(self.bytes_per_s, 1.0)
