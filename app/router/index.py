"""What each replica holds, as its KV events said, and the score that picks a replica.

    replica ──KV events──▶ ReplicaIndex: medium → {salted block hash}
    request ──tokens, tenant salt──▶ block hashes h0..hn ──▶ cost per replica ──▶ the cheapest

The index is keyed by the same salted hashes the replicas use (cache.hashing): the router derives
a tenant's salt from the server secret exactly as a replica does, so a prompt is matched only
against blocks of its own namespace, and the index holds no token and no text.

The score (one knob, ``load_weight``):

    cached(r)  = block_size × (fast(r) + disk_weight × (stored(r) − fast(r))
                              + shared_weight × (shared(r) − stored(r)))
    cost(r)    = (prompt tokens − cached(r)) + load_weight × outstanding(r)

``fast(r)``: the longest prefix of the prompt's blocks r holds in device or host memory;
``stored(r)``: the longest it holds anywhere local (device, host or its disk); ``shared(r)``: where
r writes every block through to a store other replicas share (`/admin/replica` ``shared_store``),
the longest prefix any replica of that store announced (r loads those from the store: a shared
store announces nothing itself). ``outstanding(r)``: tokens this router sent to r that r has
not finished: the prompt tokens still to compute until the first answer byte comes back, plus
the tokens to generate until the end. The cheapest healthy replica wins; ties go to the one with
fewer requests in flight, then in turn. ``load_weight`` 0 routes on the prefix alone; a large one
routes on load alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

FAST_MEDIUMS = ("GPU", "CPU")
LOCAL_MEDIUMS = ("GPU", "CPU", "DISK")
DISK_WEIGHT = 0.9  # a disk hit costs about a tenth of recomputing (docs/benchmarks.md, tier_bench)
SHARED_WEIGHT = 0.85  # a shared-store (Redis) hit costs a little more than a disk hit (same source)


@dataclass(slots=True)
class ReplicaIndex:
    """The blocks one replica announced, per medium."""

    held: dict[str, set[bytes]] = field(default_factory=dict)
    clears: int = 0

    def stored(self, medium: str, hashes: Sequence[bytes]) -> None:
        self.held.setdefault(medium, set()).update(hashes)

    def removed(self, medium: str, hashes: Sequence[bytes]) -> None:
        held = self.held.get(medium)
        if held:
            held.difference_update(hashes)

    def clear(self) -> None:
        self.held.clear()
        self.clears += 1

    def apply(self, event: list) -> None:
        """One event as published (engine/kv_events.py: vLLM's array-like layout)."""
        kind = event[0]
        if kind == "AllBlocksCleared":
            self.clear()
        elif kind == "BlockStored":
            self.stored(str(event[6]), event[1])
        elif kind == "BlockRemoved":
            self.removed(str(event[2]), event[1])

    def prefix(self, hashes: Sequence[bytes], mediums: Sequence[str]) -> int:
        """How many leading blocks of ``hashes`` this replica holds in one of ``mediums``."""
        sets = [self.held[m] for m in mediums if m in self.held]
        n = 0
        for h in hashes:
            if not any(h in s for s in sets):
                break
            n += 1
        return n

    def holds(self, block_hash: bytes) -> bool:
        """Whether this replica announced ``block_hash`` in any medium."""
        return any(block_hash in keys for keys in self.held.values())

    def blocks(self) -> dict[str, int]:
        return {medium: len(keys) for medium, keys in sorted(self.held.items())}


@dataclass(frozen=True, slots=True)
class Estimate:
    """One replica's side of a routing decision."""

    replica: int
    cached_tokens: float
    fast_blocks: int
    stored_blocks: int
    shared_blocks: int
    outstanding: int
    in_flight: int
    cost: float


def shared_prefix(peers: Sequence[ReplicaIndex], hashes: Sequence[bytes]) -> int:
    """How many leading blocks of ``hashes`` some replica of ``peers`` announced (each block may
    come from another one: all of them write to the same shared store)."""
    n = 0
    for h in hashes:
        if not any(peer.holds(h) for peer in peers):
            break
        n += 1
    return n


def estimate(replica: int, index: ReplicaIndex, hashes: Sequence[bytes], prompt_tokens: int, block_size: int,
             outstanding: int, in_flight: int, load_weight: float,
             peers: Sequence[ReplicaIndex] = ()) -> Estimate:
    """``peers``: the indexes of the replicas writing through to the store ``replica`` reads (itself
    included), or none."""
    fast = index.prefix(hashes, FAST_MEDIUMS)
    stored = max(fast, index.prefix(hashes, LOCAL_MEDIUMS))
    shared = max(stored, shared_prefix(peers, hashes[stored:]) + stored if peers else stored)
    cached = block_size * (fast + DISK_WEIGHT * (stored - fast) + SHARED_WEIGHT * (shared - stored))
    cost = (prompt_tokens - cached) + load_weight * outstanding
    return Estimate(replica, cached, fast, stored, shared, outstanding, in_flight, cost)


def choose(estimates: Sequence[Estimate], turn: int = 0) -> Estimate:
    """The cheapest; among equals the one with fewer requests in flight, then the next in turn
    after ``turn`` (so equal replicas share the load)."""
    if not estimates:
        raise ValueError("no replica to choose from")
    n = max(e.replica for e in estimates) + 1
    return min(estimates, key=lambda e: (e.cost, e.in_flight, (e.replica - turn) % n))
