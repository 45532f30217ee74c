"""KV events: what a replica says about its blocks — stored, removed, all cleared — for a router.

    step loop ─┐ BlockPool.cache_block / _evict          ┌─ publisher thread (engine/kv_events.py)
               ├ host tier: index / delete / evict       │  drains, merges runs, msgpack, ZMQ PUB
    I/O loop ──┤ disk tier: index / drop                 │
               └ shared store: written / deleted ──▶ EventLog (one lock, bounded) ──▶ subscribers

Every place that makes a block enter or leave a medium calls its `MediumEvents` sink beside the
tier's own bookkeeping, so what is announced is exactly what the tier's index holds. A sink costs
one lock and one append per block; `NO_EVENTS` (events off) costs a method call that returns.

Hashes are the salted block keys (cache.hashing): no token ids, no text, no tenant name. The
medium names follow vLLM's ("GPU" is the engine's own KV pool, whatever the device) with one per
locality of the tier protocol below it.

The log never blocks a producer. Past ``max_events`` waiting it empties itself and queues one
`AllBlocksCleared` instead (counted in ``resyncs``): a subscriber then forgets this replica's
blocks and learns them again from later events, so its index holds fewer blocks than the replica
(it routes with less affinity) but never one the replica lost track of.
"""

from __future__ import annotations

import threading
from collections import Counter, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

STORED = "BlockStored"
REMOVED = "BlockRemoved"
CLEARED = "AllBlocksCleared"

# the engine's pool, then each tier by `TierTraits.locality`
DEVICE_MEDIUM = "GPU"
MEDIUMS = {"host": "CPU", "node-ssd": "DISK", "remote": "REMOTE"}


def medium_of(locality: str) -> str:
    """The medium a tier of ``locality`` announces its blocks under (its locality upper-cased
    when vLLM has no name for it)."""
    return MEDIUMS.get(locality, locality.upper())


@dataclass(slots=True)
class Event:
    """One event as queued: ``kind`` is STORED, REMOVED or CLEARED; ``parent`` (STORED only) is
    the hash of the block before ``hashes[0]`` in its prompt, when the producer knows it."""

    kind: str
    medium: str | None = None
    hashes: list[bytes] = field(default_factory=list)
    parent: bytes | None = None


class EventLog:
    """A bounded, thread-safe queue of block events, appended anywhere, drained by one consumer."""

    def __init__(self, max_events: int = 100_000) -> None:
        if max_events <= 0:
            raise ValueError(f"max_events must be positive, got {max_events}")
        self.max_events = max_events
        self._events: deque[Event] = deque()
        self._queued = 0  # hashes waiting (a CLEARED counts one)
        self._lock = threading.Lock()
        self._ready = threading.Event()
        self.counts: Counter[tuple[str, str]] = Counter()  # (kind, medium) → blocks announced
        self.resyncs = 0  # times the log overflowed and queued AllBlocksCleared instead
        self.dropped = 0  # block events discarded by those overflows

    def stored(self, medium: str, hashes: Sequence[bytes], parent: bytes | None = None) -> None:
        if hashes:
            self._put(Event(STORED, medium, list(hashes), parent), len(hashes))

    def removed(self, medium: str, hashes: Sequence[bytes]) -> None:
        if hashes:
            self._put(Event(REMOVED, medium, list(hashes)), len(hashes))

    def cleared(self) -> None:
        """Every block this replica announced is gone (a start, a reset)."""
        self._put(Event(CLEARED), 1)

    def _put(self, event: Event, size: int) -> None:
        with self._lock:
            if self._queued + size > self.max_events:
                self.dropped += self._queued
                self._events.clear()
                self._events.append(Event(CLEARED))
                self._queued = 1
                self.resyncs += 1
                self.counts[(CLEARED, "")] += 1
                if event.kind != CLEARED:  # the event itself still counts: it happened after the reset
                    self._events.append(event)
                    self._queued += size
                    self.counts[(event.kind, event.medium or "")] += size
            else:
                self._events.append(event)
                self._queued += size
                self.counts[(event.kind, event.medium or "")] += size
        self._ready.set()

    def wait(self, timeout_s: float) -> bool:
        """Block until an event is queued or ``timeout_s`` passes; whether one is."""
        return self._ready.wait(timeout_s)

    def drain(self) -> list[Event]:
        """Every queued event in order, runs merged: consecutive removals from one medium become
        one event, and so do stores that continue one another's chain."""
        with self._lock:
            events = list(self._events)
            self._events.clear()
            self._queued = 0
            self._ready.clear()
        return merge(events)

    def __len__(self) -> int:
        return self._queued


def merge(events: Iterable[Event]) -> list[Event]:
    out: list[Event] = []
    for event in events:
        last = out[-1] if out else None
        if last is not None and last.kind == event.kind and last.medium == event.medium and (
                event.kind == REMOVED or (event.kind == STORED and event.parent == last.hashes[-1])):
            last.hashes.extend(event.hashes)
        else:
            out.append(Event(event.kind, event.medium, list(event.hashes), event.parent))
    return out


class MediumEvents:
    """The sink one producer holds: its medium's events into a log."""

    __slots__ = ("log", "medium")

    def __init__(self, log: EventLog, medium: str) -> None:
        self.log = log
        self.medium = medium

    def stored(self, key: bytes, parent: bytes | None = None) -> None:
        self.log.stored(self.medium, (key,), parent)

    def removed(self, key: bytes) -> None:
        self.log.removed(self.medium, (key,))

    def stored_all(self, keys: Sequence[bytes]) -> None:
        self.log.stored(self.medium, keys)

    def removed_all(self, keys: Sequence[bytes]) -> None:
        self.log.removed(self.medium, keys)


class NoEvents:
    """The sink when events are off."""

    __slots__ = ()

    def stored(self, key: bytes, parent: bytes | None = None) -> None:
        pass

    def removed(self, key: bytes) -> None:
        pass

    def stored_all(self, keys: Sequence[bytes]) -> None:
        pass

    def removed_all(self, keys: Sequence[bytes]) -> None:
        pass


NO_EVENTS = NoEvents()
