"""CircuitBreaker: how a tier on the network stops waiting for a store that does not answer.

After ``failures_to_open`` consecutive failures the breaker opens: for ``open_s`` seconds `allow`
says no and the tier answers "miss" at once, so a dead or frozen store costs a request no
timeout. Then it lets one probe through (half-open); a success closes it, a failure opens it again.
"""

from __future__ import annotations

import logging
import time

logger = logging.getLogger(__name__)


class CircuitBreaker:
    """closed → (N failures) → open for a while → half-open (one probe) → closed or open."""

    def __init__(self, failures_to_open: int = 3, open_s: float = 5.0) -> None:
        self.failures_to_open = failures_to_open
        self.open_s = open_s
        self.failures = 0
        self.opened_at: float | None = None
        self.trips = 0

    @property
    def state(self) -> str:
        if self.opened_at is None:
            return "closed"
        return "open" if time.monotonic() - self.opened_at < self.open_s else "half-open"

    def allow(self) -> bool:
        return self.state != "open"

    def success(self) -> None:
        if self.opened_at is not None:
            logger.info("remote cache reachable again; circuit closed")
        self.failures = 0
        self.opened_at = None

    def failure(self) -> None:
        self.failures += 1
        if self.opened_at is not None or self.failures >= self.failures_to_open:
            if self.opened_at is None:
                self.trips += 1
            self.opened_at = time.monotonic()
