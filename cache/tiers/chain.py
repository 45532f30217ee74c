"""TierChain: the tiers below the device pool, beside the step loop, with their I/O on a thread
of its own. Tiers take part by the role they declare (cache.tiers.base): one ``memory`` tier
(host slots), any number of ``store`` tiers (local, indexed), one ``shared`` tier.

    step loop thread                                     I/O thread (asyncio)
    device eviction ─ demote ─▶ memory ─ evicted ─▶ writes ─▶ every store (tmp, fsync, rename)
    admission ─ promote ◀─ memory (copy, or a row traded on CPU)
    add_request ─ prefetch(store blocks, memory slots) ─▶ store.read_many ─▶ completions
                            (the rest: exists + get) ─▶ shared.get ───────▶ completions
    poll() ◀─ slots indexed in memory, requests released ◀─────────────────────┘

The step loop never waits on I/O: a request whose prefix continues in a store is held back
while its blocks load (other requests keep stepping) and enters the scheduler once they are in
memory: the loop reserves a slot per block and the I/O thread reads straight into it, in
batches, several batches at once. A block wanted by several requests is read once, from the
first store that holds it. Writes are bounded (``max_pending_writes``): past that they are
dropped and counted — back-pressure instead of unbounded memory. Whether a hit is worth loading
is decided by measurement: the tier's running load rate against the engine's prefill rate.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

import torch

from cache.quota import UNKNOWN
from cache.telemetry import OpTimes
from cache.tiers.base import SharedTier, Tier, TierSnapshot
from cache.tiers.ioloop import IOLoop
from cache.tiers.loads import LoadPath
from cache.tiers.prefetch import Reservation
from cache.tiers.state import ADMIT_MODES, PERSIST_MODES, ChainStats, _asdict
from cache.tiers.writes import FLUSH_WINDOW, RETRY

__all__ = ["ADMIT_MODES", "FLUSH_WINDOW", "PERSIST_MODES", "RETRY", "ChainStats", "IOLoop", "Reservation", "TierChain"]


class TierChain(LoadPath):
    """The tiers below one device pool, in order, each in the part of the data path its
    `TierTraits.role` names (cache.tiers.base): one memory tier, any number of stores, one shared
    tier, any of them absent. `WritePath` and `LoadPath` are its two halves."""

    def __init__(self, tiers: Iterable[Tier | None] = (), *, max_pending_writes: int = 256,
                 read_parallel: int = min(4, os.cpu_count() or 1), persist: str = "on_evict",
                 admit: str = "always", behind_delay_s: float = 0.0) -> None:
        super().__init__(max_pending_writes=max_pending_writes, read_parallel=read_parallel, persist=persist,
                         admit=admit, behind_delay_s=behind_delay_s)
        for tier in tiers:
            if tier is not None:
                self.attach(tier)

    def demote(self, key: bytes, src: torch.Tensor, owner: str = UNKNOWN, row: int | None = None) -> int | None:
        """A device block of ``owner`` is being evicted: keep its bytes in the next tier down.

        ``row``: the pool row holding it. When the host tier shares the pool's slab it takes that
        row instead of a copy, and the return value is the row the pool block uses from now on
        (None: the block keeps its own row)."""
        self.stats.demotions += 1
        self._seen_again(key)
        host = self.memory
        if host is not None and host.shared and row is not None:
            traded = host.adopt(key, row, owner)
            if traded is not None:
                spare, evicted = traded
                self._track(key)
                for victim, payload, victim_owner in evicted:
                    self._write(victim, payload, victim_owner)
                return spare
        if host is not None:
            for victim, payload, victim_owner in host.put(key, src, owner):
                self._write(victim, payload, victim_owner)
            if key in host:
                self._track(key)
        elif self.stores or self.shared is not None:
            self._write(key, src.cpu().numpy().tobytes(), owner)
        return None

    def attach(self, tier: Tier) -> None:
        """Put a tier in the place its role names (the place must be empty); starts the I/O loop
        if the tier needs one."""
        role = tier.traits.role
        if self.tier(tier.name) is not None:
            raise ValueError(f"the {tier.name} tier is already attached; detach it first")
        if role != "store" and getattr(self, role) is not None:
            raise ValueError(f"a {role} tier ({getattr(self, role).name}) is already attached; detach it first")
        placed: Any = tier  # (the memory tier's eviction hook, the shared tier's sender thread)
        if role == "store":
            self.stores.append(tier)
            self.ops.setdefault(f"{tier.name}_read", OpTimes())
            self.ops.setdefault(f"{tier.name}_write", OpTimes())
        else:
            setattr(self, role, tier)
        if role == "memory":
            placed.keep = self._keep_in_host
        elif self.io is None:
            self.io = IOLoop()
        if role == "shared":
            assert self.io is not None
            placed.write_executor = self.io.sender
            self.ops.setdefault(f"{tier.name}_put", OpTimes())

    def detach(self, name: str, flush_timeout_s: float = 10.0) -> Any:
        """Take the tier called ``name`` out and return it. Host blocks are written to the store
        first (when there is one); a detached store keeps its files (attaching the folder again
        finds them); in-flight reads finish on the tier they started on."""
        tier = self.tier(name)
        if tier is None:
            raise ValueError(f"the {name} tier is not attached")
        role = tier.traits.role
        if role == "memory" and self.stores:
            self.flush([], flush_timeout_s)
        if role == "store":
            self.stores.remove(tier)
        else:
            setattr(self, role, None)
        if role == "memory":
            self._staged.clear()
            self._unpersisted.clear()
            tier.keep = None
        if role == "shared":
            self._close_remote(tier)
        return tier

    def _close_remote(self, remote: SharedTier) -> None:
        if self.io is None:
            return
        try:
            self.io.submit(remote.close()).result(timeout=5)
        except Exception:  # a dead connection may fail to close; it is dropped either way
            pass

    def close(self) -> None:
        if self.io is not None:
            if self.shared is not None:
                self._close_remote(self.shared)
            self.io.close()
            self.io = None

    def telemetry(self) -> dict[str, Any]:
        """The gap metrics the chain measures: op timings, block lives, remote access pattern, and
        the bytes that describe blocks against the bytes of blocks moved."""
        out: dict[str, Any] = {"ops": {kind: op.snapshot() for kind, op in self.ops.items()},
                               "life": {t.name: t.life.snapshot() for t in self.tiers},
                               "metadata_bytes": {t.name: t.stats.metadata_bytes for t in self.tiers},
                               "data_bytes": {t.name: t.stats.bytes_read + t.stats.bytes_written for t in self.tiers}}
        if self.shared is not None:
            out["remote_access"] = self.shared.access.snapshot()
        return out

    def snapshot(self) -> dict[str, Any]:
        """``{"chain": counters, <tier name>: that tier's state, ...}``, tiers top down; each tier's
        entry has its counters, occupancy, cost model, ``traits`` and what `describe` adds."""
        out: dict[str, Any] = {"chain": {**_asdict(self.stats), "pending_writes": self._pending_writes,
                                         "inflight_reads": len(self._inflight), "persist": self.persist,
                                         "behind_delay_s": self.behind_delay_s,
                                         "admit": self.admit,
                                         "unpersisted_blocks": len(self._unpersisted)}}
        for tier in self.tiers:
            out[tier.name] = TierSnapshot.of(tier).to_dict()
        return out
