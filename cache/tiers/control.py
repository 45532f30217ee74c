"""Chain-level helpers of the cache control API (engine/cache_control.py): which tier holds
which blocks, dropping blocks from every tier, and the book of pins.

    step loop                                   I/O loop
    presence(chain, keys)  (index lookups only)
    drop_local(chain, keys) → host              drop_stores(chain, keys) → every store (files)
    PinBook: keys held, by whom, until when     remote.exists / delete / delete_owner
             (host and disk eviction consult it)

Everything here reads the chain through its public attributes (`memory`, `stores`, `shared`,
`io`, `on_lower_tier`); the tiers' own indexes answer membership without I/O. Anything that
touches files or the network is a coroutine for the chain's I/O loop.
"""

from __future__ import annotations

import asyncio
import heapq
import math
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

# How long a delete waits for a disk write of one of its blocks that was in flight when it came
# (that write would index the block again after the delete)
WRITE_SETTLE_S = 2.0


@dataclass(slots=True)
class Presence:
    """Where each of a prompt's blocks is, top down: one row of tier names per block."""

    tiers: list[str]  # every tier that could hold a block, top down ("device" first)
    rows: list[list[str]] = field(default_factory=list)  # per block: the tiers holding it

    def leading(self, among: set[str] | None = None) -> int:
        """How many leading blocks some tier holds (some tier ``among`` these, if given)."""
        n = 0
        while n < len(self.rows) and (self.rows[n] if among is None else among & set(self.rows[n])):
            n += 1
        return n

    def came_up(self, before: Presence, among: set[str], shared: str) -> dict[str, int]:
        """Of the leading blocks now held ``among`` these tiers, how many were not ``before``, by
        the tier they were in then (``shared`` when no local tier held them: the shared tier's)."""
        loaded: dict[str, int] = {}
        for was in before.rows[: self.leading(among)]:
            if not among & set(was):
                source = was[0] if was else shared
                loaded[source] = loaded.get(source, 0) + 1
        return loaded

    def by_tier(self) -> dict[str, int]:
        """Of the leading blocks some tier holds, how many each tier would serve (the first tier,
        top down, holding the block)."""
        out = dict.fromkeys(self.tiers, 0)
        for row in self.rows[: self.leading()]:
            out[row[0]] += 1
        return out

    def blocks(self) -> dict[str, int]:
        """How many of the blocks each tier holds, leading or not."""
        out = dict.fromkeys(self.tiers, 0)
        for row in self.rows:
            for name in row:
                out[name] += 1
        return out

    def add_remote(self, name: str, found: Sequence[bool]) -> None:
        """Fold in the shared tier's answer to an existence check of every block."""
        if name not in self.tiers:
            self.tiers.append(name)
        for row, present in zip(self.rows, found, strict=True):
            if present:
                row.append(name)


def presence(chain: Any, keys: Sequence[bytes], on_device: Any) -> Presence:
    """Which local tier holds each of ``keys``: ``on_device(key)`` for the device pool, then the
    chain's memory tier (a block whose disk write is in flight counts as there: a request would
    recall it) and each store. No I/O: index lookups only (step loop)."""
    tiers = ["device"]
    memory = chain.memory if chain is not None else None
    stores = list(chain.stores) if chain is not None else []
    if memory is not None:
        tiers.append(memory.name)
    tiers += [store.name for store in stores]
    rows = []
    for key in keys:
        row = ["device"] if on_device(key) else []
        if chain is not None and chain.on_lower_tier(key):
            row.append(memory.name if memory is not None else stores[0].name if stores else "device")
        row += [store.name for store in stores if key in store and store.name not in row]
        rows.append(row)
    return Presence(tiers, rows)


def drop_local(chain: Any, keys: Iterable[bytes]) -> int:
    """Delete ``keys`` from the chain's memory tier (step loop); how many it held."""
    memory = chain.memory if chain is not None else None
    if memory is None:
        return 0
    return sum(1 for key in keys if memory.delete(key))


def may_land(chain: Any, key: bytes) -> bool:
    """Whether ``key`` may still reach a store after a delete: held above the stores, or a write
    of it (an eviction's or a background one) in flight."""
    return bool(chain.on_lower_tier(key) or chain.write_in_flight(key))


async def drop_stores(chain: Any, stores: Sequence[Any], keys: Sequence[bytes], settle: Sequence[bytes] = ()
                      ) -> dict[str, int]:
    """Delete ``keys`` from each of ``stores`` (files unlinked on a worker thread, never the I/O
    loop itself); per store, how many it held. ``settle``: blocks whose disk write was in flight
    when the delete came (`may_land`): waited for (up to `WRITE_SETTLE_S`) and deleted once
    written."""
    loop = asyncio.get_running_loop()

    def delete_all(batch: Sequence[bytes]) -> dict[str, int]:
        return {store.name: sum(1 for key in batch if store.delete(key)) for store in stores}

    dropped = await loop.run_in_executor(None, delete_all, list(keys))

    async def delete_landed(done: list[bytes]) -> None:
        for name, n in (await loop.run_in_executor(None, delete_all, done)).items():
            dropped[name] += n

    await _when_landed(settle, lambda pending: [k for k in pending if may_land(chain, k)], delete_landed)
    return dropped


async def settle_writes(chain: Any) -> bool:
    """Wait (up to `WRITE_SETTLE_S`) until no block write is in flight, so that a delete of
    everything an owner holds also finds what was being written when it came; whether none is."""
    deadline = time.monotonic() + WRITE_SETTLE_S
    while chain.pending_writes and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    return not chain.pending_writes


async def settle_shared(chain: Any, shared: Any, keys: Sequence[bytes], tag: str | None) -> int:
    """Delete again, from the shared tier, those of ``keys`` whose write was in flight when a
    delete came (they would land after it), once written (up to `WRITE_SETTLE_S`); how many it
    held then. A failed delete counts 0 (their TTL ends them)."""
    deleted = 0

    async def delete_landed(done: list[bytes]) -> None:
        nonlocal deleted
        deleted += await shared.delete(done, tag) or 0

    await _when_landed(keys, chain.remote_in_flight, delete_landed)
    return deleted


async def _when_landed(keys: Sequence[bytes], in_flight: Callable[[list[bytes]], Sequence[bytes]],
                       act: Callable[[list[bytes]], Awaitable[None]]) -> None:
    """Call ``act`` with each of ``keys`` once ``in_flight`` no longer lists it (its write ended),
    polling until all have or `WRITE_SETTLE_S` passes: what a delete does again for blocks whose
    writes were in flight when it came, and so land after it."""
    pending = list(keys)
    deadline = time.monotonic() + WRITE_SETTLE_S
    while pending and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
        flying = set(in_flight(pending))
        done = [key for key in pending if key not in flying]
        if done:
            await act(done)
            pending = [key for key in pending if key in flying]


@dataclass(slots=True)
class PinSnapshot:
    """The book's figures for `/admin/metrics` (under ``cache_control``)."""

    pinned_keys: int  # blocks held by at least one pin
    protected_keys: int  # blocks held only by prefetch protections (with a TTL)
    by_tenant: dict[str, int]  # blocks each holder holds (pins and protections)
    expired: int  # prefetch protections that ran out


class PinBook:
    """Which blocks are held in memory, by whom (tenant names) and until when (`math.inf`: a pin;
    a time: a prefetch's protection). A `Container` of block hashes: the host and disk tiers
    consult it when they evict (``tier.protected = book``). Step loop only; the tiers' I/O threads
    only test membership."""

    def __init__(self) -> None:
        self._holds: dict[bytes, dict[str, float]] = {}  # key → {holder: until}
        self._by_holder: dict[str, set[bytes]] = {}
        self._expiries: list[tuple[float, bytes, str]] = []  # a heap of (until, key, holder)
        self.expired = 0

    def __contains__(self, key: object) -> bool:
        return key in self._holds

    def __len__(self) -> int:
        return len(self._holds)

    def __iter__(self) -> Iterator[bytes]:
        return iter(list(self._holds))

    @property
    def expiring(self) -> bool:
        """Whether some protection has a time to run out at."""
        return bool(self._expiries)

    def held_by(self, holder: str) -> int:
        """Blocks ``holder`` holds (pinned or protected)."""
        return len(self._by_holder.get(holder, ()))

    def holds(self, holder: str, key: bytes) -> bool:
        return holder in self._holds.get(key, {})

    def is_pinned(self, key: bytes) -> bool:
        """Held by a pin (not only by a protection that runs out)."""
        return any(math.isinf(until) for until in self._holds.get(key, {}).values())

    def hold(self, holder: str, keys: Iterable[bytes], until: float = math.inf) -> int:
        """``holder`` holds ``keys`` until ``until`` (a later time of an existing hold wins);
        returns how many it did not hold before."""
        fresh = 0
        for key in keys:
            holders = self._holds.setdefault(key, {})
            before = holders.get(holder)
            if before is None:
                fresh += 1
                self._by_holder.setdefault(holder, set()).add(key)
            if before is None or until > before:
                holders[holder] = until
                if not math.isinf(until):
                    heapq.heappush(self._expiries, (until, key, holder))
        return fresh

    def release(self, holder: str, keys: Iterable[bytes]) -> int:
        """``holder`` lets go of ``keys``; how many it held."""
        released = 0
        for key in keys:
            holders = self._holds.get(key)
            if holders is None or holders.pop(holder, None) is None:
                continue
            released += 1
            if not holders:
                del self._holds[key]
            mine = self._by_holder[holder]
            mine.discard(key)
            if not mine:
                del self._by_holder[holder]
        return released

    def cost(self, holder: str, keys: Iterable[bytes]) -> tuple[int, int]:
        """What holding ``keys`` would add: (blocks ``holder`` does not hold yet, blocks nobody holds yet)."""
        fresh = [key for key in keys if not self.holds(holder, key)]
        return len(fresh), sum(1 for key in fresh if key not in self._holds)

    def hold_within(self, holder: str, keys: Sequence[bytes], until: float, limit: int, quota: int | None) -> int:
        """Hold ``keys`` from the first on, as many as fit: no more than ``limit`` blocks held in all
        and ``quota`` blocks (if given) held by ``holder``; returns how many ``holder`` now holds."""
        room = limit - len(self._holds)
        own_room = quota - self.held_by(holder) if quota is not None else len(keys)
        take: list[bytes] = []
        for key in keys:
            if not self.holds(holder, key):
                if room <= 0 or own_room <= 0:
                    break
                room -= key not in self._holds
                own_room -= 1
            take.append(key)
        self.hold(holder, take, until)
        return len(take)

    def release_all(self, holder: str) -> int:
        return self.release(holder, list(self._by_holder.get(holder, ())))

    def expire(self, now: float) -> int:
        """Let go of the protections whose time has come; how many."""
        expired = 0
        while self._expiries and self._expiries[0][0] <= now:
            until, key, holder = heapq.heappop(self._expiries)
            if self._holds.get(key, {}).get(holder) == until:  # (not renewed, released or pinned since)
                self.release(holder, [key])
                expired += 1
        self.expired += expired
        return expired

    def snapshot(self) -> PinSnapshot:
        pinned = sum(1 for key in self._holds if self.is_pinned(key))
        return PinSnapshot(pinned_keys=pinned, protected_keys=len(self._holds) - pinned,
                           by_tenant={h: len(keys) for h, keys in self._by_holder.items()}, expired=self.expired)


def attach_book(chain: Any, book: PinBook) -> None:
    """Make every tier of ``chain`` that evicts by the book consult it (after attaches too)."""
    if chain is None:
        return
    for tier in chain.tiers:
        if hasattr(tier, "protected") and tier.protected is not book:
            tier.protected = book
