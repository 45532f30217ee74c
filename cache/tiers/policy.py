"""Eviction policies for a tier's fixed number of equal-sized entries: LRU and S3-FIFO.

A policy only orders keys; the tier owns the data. ``insert`` a new key, ``touch`` it on a hit,
``remove`` it when deleted, and ask ``evict`` for the next victim when full.

Pinned blocks (the cache control API: engine/cache_control.py) stay in the tier however cold
they get: `ProtectedPolicy` wraps a policy so that ``evict`` passes over the keys a ``protected``
predicate names, and `ProtectingLedger` keeps a tenant quota's choice off them too.

S3-FIFO (Yang et al., SOSP 2023) resists scans: new keys enter a small FIFO (10 %); those hit
again while there move to the main FIFO, the rest leave and are remembered in a ghost list, so a
key seen twice in a while goes straight to main. One-off long prompts then pass through the
small queue without pushing a hot prefix out of main, where LRU would evict the hot prefix.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Protocol

from cache.quota import QuotaLedger


class EvictionPolicy(Protocol):
    def insert(self, key: Hashable) -> None: ...
    def touch(self, key: Hashable) -> None: ...
    def remove(self, key: Hashable) -> None: ...
    def evict(self) -> Hashable: ...
    def __len__(self) -> int: ...


class LRUPolicy:
    """Least recently used first."""

    def __init__(self, capacity: int) -> None:
        self._order: OrderedDict[Hashable, None] = OrderedDict()

    def insert(self, key: Hashable) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def touch(self, key: Hashable) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def remove(self, key: Hashable) -> None:
        self._order.pop(key, None)

    def evict(self) -> Hashable:
        key, _ = self._order.popitem(last=False)
        return key

    def __len__(self) -> int:
        return len(self._order)


class S3FIFOPolicy:
    """Small FIFO + main FIFO + ghost keys; 2-bit access counts."""

    def __init__(self, capacity: int, small_ratio: float = 0.1) -> None:
        self.small_cap = max(1, int(capacity * small_ratio))
        self.ghost_cap = max(1, capacity - self.small_cap)
        self._small: OrderedDict[Hashable, None] = OrderedDict()
        self._main: OrderedDict[Hashable, None] = OrderedDict()
        self._ghost: OrderedDict[Hashable, None] = OrderedDict()
        self._freq: dict[Hashable, int] = {}

    def insert(self, key: Hashable) -> None:
        if key in self._freq:
            self.touch(key)
            return
        self._freq[key] = 0
        if key in self._ghost:  # seen recently: it earned a place in main
            del self._ghost[key]
            self._main[key] = None
        else:
            self._small[key] = None

    def touch(self, key: Hashable) -> None:
        if key in self._freq:
            self._freq[key] = min(3, self._freq[key] + 1)

    def remove(self, key: Hashable) -> None:
        self._freq.pop(key, None)
        self._small.pop(key, None)
        self._main.pop(key, None)

    def evict(self) -> Hashable:
        while True:
            if self._small and (len(self._small) >= self.small_cap or not self._main):
                key, _ = self._small.popitem(last=False)
                if self._freq[key] > 0:
                    self._freq[key] = 0
                    self._main[key] = None
                    continue
                self._ghost[key] = None
                if len(self._ghost) > self.ghost_cap:
                    self._ghost.popitem(last=False)
                del self._freq[key]
                return key
            key, _ = self._main.popitem(last=False)
            if self._freq[key] > 0:
                self._freq[key] -= 1
                self._main[key] = None
                continue
            del self._freq[key]
            return key

    def __len__(self) -> int:
        return len(self._freq)


class AllProtected(LookupError):
    """Every key a strict `ProtectedPolicy` orders is protected: nothing may be evicted."""


class ProtectedPolicy:
    """A policy whose ``evict`` passes over protected keys (pins), in the inner policy's order.

    Keys passed over go back in as just inserted, so the next eviction does not meet them again
    at once. When every key is protected, a ``strict`` policy raises `AllProtected` (the host tier
    then lets the incoming block pass through to the tier below); a lenient one evicts the first
    protected key after all (a disk tier must make room for a write it already accepted).
    """

    def __init__(self, inner: EvictionPolicy, protected: Callable[[Hashable], bool], strict: bool = True) -> None:
        self.inner = inner
        self.protected = protected
        self.strict = strict

    def insert(self, key: Hashable) -> None:
        self.inner.insert(key)

    def touch(self, key: Hashable) -> None:
        self.inner.touch(key)

    def remove(self, key: Hashable) -> None:
        self.inner.remove(key)

    def evict(self) -> Hashable:
        passed: list[Hashable] = []
        try:
            while len(self.inner):
                key = self.inner.evict()
                if not self.protected(key):
                    return key
                passed.append(key)
            if self.strict or not passed:
                raise AllProtected("every block of the tier is pinned")
            return passed.pop(0)
        finally:
            for key in passed:
                self.inner.insert(key)

    def __len__(self) -> int:
        return len(self.inner)


class ProtectingLedger(QuotaLedger):
    """A quota ledger whose choice of victim never falls on a protected key (a pin): a tenant at
    its quota gives up its oldest unpinned block, and a tenant over its fair share loses unpinned
    blocks only."""

    def __init__(self, capacity: int, protected: Callable[[Hashable], bool]) -> None:
        super().__init__(capacity)
        self.protected = protected

    def choose(self, owner: str, policy_choice: Hashable | None,
               evictable: Callable[[Hashable], bool] = lambda key: True) -> Hashable | None:
        return super().choose(owner, policy_choice, lambda key: evictable(key) and not self.protected(key))

    def has_unprotected(self, owner: str) -> bool:
        """Whether ``owner`` holds a block here that is not protected (one it could give up)."""
        return any(not self.protected(key) for key in self.oldest(owner))


POLICIES = {"lru": LRUPolicy, "s3fifo": S3FIFOPolicy}


def make_policy(name: str, capacity: int) -> EvictionPolicy:
    try:
        return POLICIES[name](capacity)
    except KeyError:
        raise ValueError(f"unknown eviction policy {name!r}; use one of {sorted(POLICIES)}") from None
