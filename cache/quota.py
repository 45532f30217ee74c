"""QuotaLedger: who holds each block of one tier, and whose block an eviction may take.

Every tier (device pool, host slab, disk folder) keeps one ledger beside its eviction policy.
Owners are plain strings (the engine passes tenant names; ``PUBLIC`` for the blocks of a declared
public prefix; ``UNKNOWN`` for blocks whose writer is not known, e.g. files found on disk after a
restart). A tenant's limit comes from its request (``quota = {device, host, disk, remote}``).

While no limit is set the tier evicts as its policy says and the ledger only counts. Once any
limit is set, the victim for a block that ``owner`` is about to store is chosen so that:

1. an owner at its quota gives up its own least recently used block first;
2. otherwise the policy's choice stands if its owner may lose it: the block is the caller's own,
   unowned, or its owner holds more than its allowance (its quota, or its fair share of the
   tier: capacity / number of owners, whichever is smaller);
3. otherwise the least recently used block of the owner furthest above its allowance is taken,
   so a tenant flooding the tier never pushes another below its fair share.

    owner  count  quota  allowance (capacity 100, 3 owners → fair 33)
    noisy    60     20     20    ← over: its blocks go first
    quiet    15      -     33    ← protected
    public   25      -     33    ← protected
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator
from typing import Any

PUBLIC = "#public"  # owner of public-prefix blocks (tenant names cannot start with '#')
UNKNOWN = ""  # owner not known: always the first to go


class QuotaLedger:
    """Per-owner block counts and recency for one tier; not thread-safe (callers lock)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._limits: dict[str, int] = {}
        self._owner_of: dict[Hashable, str] = {}
        self._by_owner: dict[str, OrderedDict[Hashable, None]] = {}
        self.own_evictions = 0  # blocks an owner at its quota gave up to store another of its own
        self.protected_skips = 0  # times the policy's victim was spared (owner within its allowance)

    # ---- limits ------------------------------------------------------------------------------
    @property
    def active(self) -> bool:
        """Whether any owner has a limit (else evictions follow the policy alone)."""
        return bool(self._limits)

    def set_limit(self, owner: str, blocks: int | None) -> None:
        if blocks is None:
            self._limits.pop(owner, None)
        else:
            self._limits[owner] = blocks

    def limit(self, owner: str) -> int | None:
        return self._limits.get(owner)

    # ---- membership --------------------------------------------------------------------------
    def add(self, key: Hashable, owner: str) -> None:
        """``key`` is now held in the tier for ``owner`` (a key already held keeps its owner)."""
        if key in self._owner_of:
            self.touch(key)
            return
        self._owner_of[key] = owner
        self._by_owner.setdefault(owner, OrderedDict())[key] = None

    def touch(self, key: Hashable) -> None:
        owner = self._owner_of.get(key)
        if owner is not None:
            self._by_owner[owner].move_to_end(key)

    def remove(self, key: Hashable) -> str | None:
        owner = self._owner_of.pop(key, None)
        if owner is not None:
            keys = self._by_owner[owner]
            del keys[key]
            if not keys:
                del self._by_owner[owner]
        return owner

    def owner_of(self, key: Hashable) -> str | None:
        return self._owner_of.get(key)

    def count(self, owner: str) -> int:
        keys = self._by_owner.get(owner)
        return len(keys) if keys else 0

    def __len__(self) -> int:
        return len(self._owner_of)

    def counts(self) -> dict[str, int]:
        return {owner: len(keys) for owner, keys in self._by_owner.items()}

    def oldest(self, owner: str) -> Iterator[Hashable]:
        """``owner``'s keys, least recently used first (do not change the ledger while iterating)."""
        return iter(self._by_owner.get(owner, ()))

    # ---- eviction ----------------------------------------------------------------------------
    def fair_share(self) -> int:
        owners = sum(1 for owner in self._by_owner if owner != UNKNOWN)
        return self.capacity // max(1, owners)

    def allowance(self, owner: str) -> int:
        fair = self.fair_share()
        limit = self._limits.get(owner)
        return fair if limit is None else min(limit, fair)

    def admits(self, owner: str) -> bool:
        """False for an owner whose quota in this tier is 0 (its blocks skip the tier)."""
        return self._limits.get(owner) != 0

    def at_quota(self, owner: str) -> bool:
        limit = self._limits.get(owner)
        return limit is not None and self.count(owner) >= limit

    def may_lose(self, key: Hashable, owner: str) -> bool:
        """Whether storing a block for ``owner`` may evict ``key``."""
        holder = self._owner_of.get(key, UNKNOWN)
        return holder in (owner, UNKNOWN) or self.count(holder) > self.allowance(holder)

    def choose(self, owner: str, policy_choice: Hashable | None,
               evictable: Callable[[Hashable], bool] = lambda key: True) -> Hashable | None:
        """The key to evict so that ``owner`` can store one more block (None: nothing evictable).

        ``policy_choice`` is the tier policy's own victim; ``evictable`` says whether a key can
        go at all (on the device, only blocks no request holds).
        """
        if not self.active:
            return policy_choice
        if self.at_quota(owner):
            for key in self.oldest(owner):
                if evictable(key):
                    self.own_evictions += 1
                    return key
        if policy_choice is None or self.may_lose(policy_choice, owner):
            return policy_choice
        self.protected_skips += 1
        surplus = {holder: self.count(holder) - self.allowance(holder) for holder in self._by_owner}
        for holder in sorted(surplus, key=lambda h: (h != UNKNOWN, -surplus[h])):
            if holder not in (owner, UNKNOWN) and surplus[holder] <= 0:
                continue  # within its allowance: protected
            for key in self._by_owner[holder]:
                if evictable(key):
                    return key
        return policy_choice

    def snapshot(self) -> dict[str, object]:
        return {"owners": self.counts(), "limits": dict(self._limits), "fair_share": self.fair_share(),
                "own_evictions": self.own_evictions, "protected_skips": self.protected_skips}


def pick_victim(policy: Any, ledger: QuotaLedger, owner: str) -> Hashable:
    """Evict one key from a tier's ``policy`` (a non-empty `cache.tiers.policy` policy) on behalf
    of ``owner``: the policy's own victim unless the ledger protects it, in which case the spared
    key goes back into the policy (as if just inserted) and the ledger's choice leaves instead."""
    candidate = policy.evict()
    if not ledger.active:
        return candidate
    victim = ledger.choose(owner, candidate)
    if victim is None or victim == candidate:
        return candidate
    policy.remove(victim)
    policy.insert(candidate)
    return victim
