"""Per-tenant admission limits: requests per second (a token bucket with a burst), tokens per
minute (prompt tokens plus the output budget, a second bucket) and concurrent requests.

`RateLimiter.acquire` either admits a request, returning a `Slot` that must be released once the
request is over (released exactly once however often it is called), or refuses it with the
number of seconds after which the same request would be admitted — exact for the buckets, a
fixed short wait for concurrency (a slot frees when some request ends, which nobody can
predict). State is kept per tenant name, so it survives a registry reload and new limits apply
to the next request. Everything runs on the event loop: no locks.

    bucket: capacity = burst, refilled at `rate` per second; a request takes 1 (or its tokens)
    t=0  ●●●●● (burst 5)  → five requests admitted at once, the sixth waits 1/rate s

The token bucket holds `tokens_per_min` tokens and refills at `tokens_per_min / 60` per second. A
request counts its prompt tokens plus `max_tokens × n` (its most possible output), taken when it
is admitted and never given back. One request costing more than a whole minute's budget waits for
a full bucket and then empties it, so it is slow but never refused forever. Concurrency is checked
first, then requests, then tokens; a refused request takes nothing from any bucket.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

CONCURRENCY_RETRY_S = 1.0


@dataclass(frozen=True, slots=True)
class TenantLimits:
    """A tenant's admission limits; None = unlimited."""

    requests_per_s: float | None = None
    burst: int | None = None  # default: ceil(requests_per_s), at least 1
    tokens_per_min: int | None = None
    max_concurrent: int | None = None

    def __post_init__(self) -> None:
        for name in ("requests_per_s", "burst", "tokens_per_min", "max_concurrent"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                      or not math.isfinite(value) or not value > 0):
                raise ValueError(f"{name} must be a positive number, got {value!r}")
        if self.burst is not None and self.requests_per_s is None:
            raise ValueError("burst needs requests_per_s")

    @property
    def any(self) -> bool:
        return any(v is not None for v in (self.requests_per_s, self.tokens_per_min, self.max_concurrent))


class TokenBucket:
    """Holds up to `capacity` tokens, refilled at `rate` per second."""

    def __init__(self, rate: float, capacity: float, now: float) -> None:
        self.rate, self.capacity = rate, capacity
        self.level, self.stamp = capacity, now

    def configure(self, rate: float, capacity: float, now: float) -> None:
        """New limits (a reload): what was refilled so far at the old rate is kept, up to `capacity`."""
        self._refill(now)
        self.rate, self.capacity = rate, capacity
        self.level = min(self.level, capacity)

    def _refill(self, now: float) -> None:
        self.level = min(self.capacity, self.level + max(0.0, now - self.stamp) * self.rate)
        self.stamp = max(self.stamp, now)

    def wait(self, amount: float, now: float) -> float:
        """Seconds until `amount` is available (0.0 = now); takes nothing."""
        self._refill(now)
        missing = min(amount, self.capacity) - self.level  # more than capacity: wait for a full bucket
        return 0.0 if missing <= 0 else missing / self.rate

    def take(self, amount: float) -> None:
        self.level -= min(amount, self.capacity)


class Slot:
    """One admitted request's concurrency slot; `release` is idempotent."""

    __slots__ = ("_state", "_released")

    def __init__(self, state: _TenantState | None) -> None:
        self._state = state
        self._released = False

    def release(self) -> None:
        if not self._released:
            self._released = True
            if self._state is not None:
                self._state.running -= 1


@dataclass(slots=True)
class Refusal:
    """Why a request was refused, and when to retry (seconds, > 0)."""

    limit: str  # requests_per_s | tokens_per_min | max_concurrent
    value: float
    retry_after_s: float

    @property
    def message(self) -> str:
        what = {"requests_per_s": f"{self.value:g} requests per second",
                "tokens_per_min": f"{self.value:g} tokens per minute (prompt + max_tokens)",
                "max_concurrent": f"{self.value:g} concurrent requests"}[self.limit]
        return (f"Rate limit reached: this API key's tenant is limited to {what}. "
                f"Retry after {math.ceil(self.retry_after_s)} s.")


@dataclass(slots=True)
class _TenantState:
    requests: TokenBucket | None = None
    tokens: TokenBucket | None = None
    running: int = 0


class RateLimiter:
    """Admission state per tenant name."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._states: dict[str, _TenantState] = {}

    def running(self, tenant: str) -> int:
        state = self._states.get(tenant)
        return state.running if state is not None else 0

    def acquire(self, tenant: str, limits: TenantLimits, tokens: int = 0) -> Slot | Refusal:
        """Admit one request of `tokens` tokens for `tenant`, or say why not and when to retry."""
        if not limits.any:
            return Slot(None)
        now = self._clock()
        state = self._states.setdefault(tenant, _TenantState())
        requests = self._bucket(state, "requests", limits.requests_per_s,
                                limits.burst or max(1, math.ceil(limits.requests_per_s or 1)), now)
        budget = self._bucket(state, "tokens", limits.tokens_per_min and limits.tokens_per_min / 60.0,
                              limits.tokens_per_min or 0, now)
        if limits.max_concurrent is not None and state.running >= limits.max_concurrent:
            return Refusal("max_concurrent", limits.max_concurrent, CONCURRENCY_RETRY_S)
        if requests is not None and (wait := requests.wait(1, now)) > 0:
            return Refusal("requests_per_s", limits.requests_per_s or 0, wait)
        if budget is not None and (wait := budget.wait(tokens, now)) > 0:
            return Refusal("tokens_per_min", limits.tokens_per_min or 0, wait)
        if requests is not None:
            requests.take(1)
        if budget is not None:
            budget.take(tokens)
        state.running += 1
        return Slot(state)

    @staticmethod
    def _bucket(state: _TenantState, name: str, rate: float | None, capacity: float, now: float) -> TokenBucket | None:
        bucket: TokenBucket | None = getattr(state, name)
        if rate is None:
            setattr(state, name, None)
            return None
        if bucket is None:
            bucket = TokenBucket(rate, capacity, now)
            setattr(state, name, bucket)
        elif (bucket.rate, bucket.capacity) != (rate, capacity):
            bucket.configure(rate, capacity, now)
        return bucket
