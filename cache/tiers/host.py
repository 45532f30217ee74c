"""HostTier: KV blocks in CPU memory, a fixed slab of equal slots (pinned when CUDA is present).

Only the engine's step-loop thread touches it: device evictions are copied in (one memcpy per
block, no serialisation), promotions copied out into a device block, and blocks that the disk
tier or the remote tier loaded are read straight into slots the loop reserved for them
(`reserve`, then `commit` or `release`), or copied in from the buffers they arrived in. When
full, the eviction policy picks a victim whose bytes are returned to the caller, who passes
them down the chain.

On CPU the slab can be the device pool's own tensor (`KVStorage.slab`): the tier then owns some
of its rows, and a block moves between the device and this tier by trading rows instead of
copying bytes — `adopt` (a demotion: the tier takes the evicted block's row and hands back one of
its free rows) and `surrender` (a promotion: it gives the block's row to the device block and
takes that block's old row as a free one). Either way every row has exactly one owner, the pool
or this tier, and the tier's capacity in rows never changes.

Blocks named by ``protected`` (a container of keys: the pins and prefetch protections of the cache
control API, engine/cache_control.py) are never chosen for eviction, by the policy nor by a
tenant quota. When every block the tier could evict is protected, an incoming block passes
through to the tier below instead of taking one's place (as a block of an owner whose host quota
is 0 does); the caller bounds how much may be protected, so that this stays an edge case.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Hashable, Iterator, Sequence
from typing import Any

import numpy
import torch

from cache.events import NO_EVENTS, MediumEvents, NoEvents
from cache.quota import UNKNOWN, pick_victim
from cache.telemetry import BlockLife
from cache.tiers.base import TierTraits
from cache.tiers.policy import AllProtected, ProtectedPolicy, ProtectingLedger, make_policy
from cache.tiers.stats import RateEstimate, TierStats

# How many eviction candidates a host eviction looks at for one that need not be kept.
KEEP_SCAN = 64


class HostTier:
    name = "host"
    traits = TierTraits(locality="host", lifetime="session", substrate="host-dram", shared=False, role="memory")

    def __init__(self, capacity_bytes: int, block_nbytes: int, policy: str = "lru", pin: bool = False,
                 slab: torch.Tensor | None = None, rows: Sequence[int] = ()) -> None:
        """A slab of ``capacity_bytes`` of its own, or (``slab`` given: [n, block_nbytes] uint8, the
        device pool's rows) the ``rows`` of that slab, which the tier then trades with the pool."""
        self.block_nbytes = block_nbytes
        self.shared = slab is not None
        self.capacity_blocks = len(rows) if slab is not None else capacity_bytes // block_nbytes
        if self.capacity_blocks <= 0:
            raise ValueError(f"host tier of {capacity_bytes} bytes holds no block of {block_nbytes} bytes")
        if slab is not None:
            if slab.dtype != torch.uint8 or slab.dim() != 2 or slab.shape[1] != block_nbytes:
                raise ValueError(f"a shared slab must be [rows, {block_nbytes}] uint8, got {tuple(slab.shape)} {slab.dtype}")
            self.slots = slab
            self._free = list(reversed(rows))
            # rows whose bytes are not a block's KV (never written, or a failed read's leftovers):
            # zeroed before the pool gets one, as its own rows are, so attention never meets NaN
            # garbage in a partly filled block
            self._unclean = set(rows)
        else:
            # torch.empty reserves address space; pages are touched only as slots fill up
            self.slots = torch.empty((self.capacity_blocks, block_nbytes), dtype=torch.uint8, pin_memory=pin)
            self._free = list(range(self.capacity_blocks - 1, -1, -1))
            self._unclean = set()
        self._index: dict[bytes, int] = {}
        self._reserved: set[int] = set()  # slots a disk read is filling (see `reserve`)
        # keys eviction passes over (pins; see the module docstring): set by the cache control
        self.protected: Collection[bytes] = frozenset()
        self.policy = ProtectedPolicy(make_policy(policy, self.capacity_blocks), self._is_protected)
        self.policy_name = policy
        self.stats = TierStats()
        self.rate = RateEstimate(bytes_per_s=5e9, latency_s=1e-5)
        self.life = BlockLife()
        self.events: MediumEvents | NoEvents = NO_EVENTS  # KV events (cache.events), where blocks come and go
        # who holds what; tenants' host quotas (never taking a protected block)
        self.ledger = ProtectingLedger(self.capacity_blocks, self._is_protected)
        # eviction passes over a victim for which keep(key) is true while another exists (the
        # chain: a block not yet on disk while disk writes are backed up)
        self.keep: Callable[[bytes], bool] | None = None
        self.kept = 0  # evictions that passed over a kept block
        # per slot, how many times a block left it: `snapshot` on another thread tells by it that
        # its copy may be torn
        self._left: dict[int, int] = {}

    def apply_quota(self, owner: str, tag: str, blocks: int | None) -> None:
        """At most ``blocks`` of ``owner``'s blocks here (None: no limit)."""
        self.ledger.set_limit(owner, blocks)

    def _is_protected(self, key: Hashable) -> bool:
        return key in self.protected  # type: ignore[operator]

    def _admits(self, owner: str) -> bool:
        """Whether a block of ``owner`` may come in: its quota is not 0, and at its quota it still
        holds an unprotected block to give up for it."""
        if not self.ledger.admits(owner):
            return False
        return not self.ledger.at_quota(owner) or self.ledger.has_unprotected(owner)

    def describe(self) -> dict[str, Any]:
        return {"quota": self.ledger.snapshot(), "shares_device_slab": self.shared,
                "kept_unpersisted": self.kept,  # evictions that passed over a block not on disk
                "pinned": sum(1 for key in self.protected if key in self._index)}  # blocks held here for a pin

    def __len__(self) -> int:
        return len(self._index)

    def __contains__(self, key: bytes) -> bool:
        return key in self._index

    @property
    def nbytes(self) -> int:
        return len(self._index) * self.block_nbytes

    def put(self, key: bytes, src: torch.Tensor | memoryview, owner: str = UNKNOWN) -> list[tuple[bytes, bytes, str]]:
        """Copy a block in for ``owner`` (``src``: its bytes as a flat uint8 tensor, or a buffer); returns the
        blocks that had to leave as (key, bytes, owner). A block whose owner has a host quota of 0,
        or that finds every slot reserved by disk reads, passes straight through (it is returned
        as if evicted)."""
        if key in self._index:
            self.touch(key)
            return []
        evicted = self._make_room(owner) if self._admits(owner) else None
        if evicted is None:  # (a quota of 0, all slots reserved, or every block protected)
            return [(key, src.cpu().numpy().tobytes() if isinstance(src, torch.Tensor) else bytes(src), owner)]
        slot = self._free.pop()
        t0 = time.perf_counter()
        if isinstance(src, torch.Tensor):
            self.slots[slot].copy_(src)
        elif not memoryview(src).readonly:  # (a Redis reply) torch copies on all threads: 2x numpy's rate
            self.slots[slot].copy_(torch.frombuffer(src, dtype=torch.uint8))
        else:  # a read-only buffer is copied by numpy: torch would want it writable
            self.slots[slot].numpy()[:] = numpy.frombuffer(src, dtype=numpy.uint8)
        self.stats.write_time_s += time.perf_counter() - t0
        self._index_slot(key, slot, owner)
        return evicted

    def put_bytes(self, key: bytes, payload: bytes | memoryview, owner: str = UNKNOWN) -> list[tuple[bytes, bytes, str]]:
        return self.put(key, memoryview(payload).cast("B"), owner)

    def touch(self, key: bytes) -> None:
        """Mark ``key``'s block as just used (a request is about to promote it)."""
        if key in self._index:
            self.policy.touch(key)
            self.ledger.touch(key)

    def reserve(self, owner: str = UNKNOWN, evict: bool = True) -> tuple[int, memoryview, list[tuple[bytes, bytes, str]]] | None:
        """A slot for a block to be read straight into (a disk or remote load), outside the index
        until `commit` or `release`: (slot, a writable view of it, blocks evicted to make room).
        None when ``owner`` may hold no host block, every slot is already reserved, or (``evict``
        False) no slot is free."""
        if not self.ledger.admits(owner) or not self._free and (not self._index or not evict):
            return None
        evicted = [] if self._free else self._make_room(owner, for_quota=False)
        if evicted is None:
            return None
        slot = self._free.pop()
        self._reserved.add(slot)
        return slot, self.slots[slot].numpy().data, evicted

    def commit(self, key: bytes, slot: int, owner: str = UNKNOWN,
               payload: memoryview | None = None) -> list[tuple[bytes, bytes, str]]:
        """A reserved slot now holds ``key``'s block for ``owner``: index it. ``payload``: the
        block as the read delivered it — the slot itself for every read the chain makes; anything
        else is copied in. Returns blocks that had to leave (``owner`` at its quota)."""
        if payload is not None:
            data = numpy.frombuffer(payload, dtype=numpy.uint8)
            if data.ctypes.data != self.slots[slot].data_ptr():  # it came in a buffer of its own
                self.slots[slot].numpy()[:] = data
        self._reserved.remove(slot)
        if key in self._index:  # the block arrived meanwhile by another path
            self._free.append(slot)
            self.touch(key)
            return []
        victim = self._evict_one(owner) if self.ledger.at_quota(owner) else None
        self._index_slot(key, slot, owner)  # (over the quota by one when all it holds is protected)
        return [victim] if victim is not None else []

    def _index_slot(self, key: bytes, slot: int, owner: str, copied: bool = True) -> None:
        """``slot`` now holds ``key``'s block for ``owner``: index it and count the write (bytes
        only when they were ``copied`` in; a row taken from the pool is a handover)."""
        self._index[key] = slot
        self._unclean.discard(slot)
        self.policy.insert(key)
        self.ledger.add(key, owner)
        self.life.inserted(key)
        self.events.stored(key)
        self.stats.puts += 1
        if copied:
            self.stats.writes += 1
            self.stats.bytes_written += self.block_nbytes
        else:
            self.stats.handovers += 1

    def release(self, slot: int) -> None:
        """A reserved slot was not filled (the read failed): free it."""
        self._reserved.remove(slot)
        self._free.append(slot)
        if self.shared:  # a partial or damaged read may have left anything there
            self._unclean.add(slot)

    def load_into(self, key: bytes, dst: torch.Tensor) -> bool:
        """Copy a block out into ``dst`` (flat uint8, e.g. a device block); False on a miss."""
        slot = self._index.get(key)
        if slot is None:
            self.stats.misses += 1
            return False
        t0 = time.perf_counter()
        dst.copy_(self.slots[slot])
        elapsed = time.perf_counter() - t0
        self.rate.observe(self.block_nbytes, elapsed)
        self.policy.touch(key)
        self.ledger.touch(key)
        self.life.accessed(key)
        self.stats.hits += 1
        self.stats.reads += 1
        self.stats.read_time_s += elapsed
        self.stats.bytes_read += self.block_nbytes
        return True

    # ---- trading rows with the device pool (shared slab only) ---------------------------------
    def adopt(self, key: bytes, row: int, owner: str = UNKNOWN) -> tuple[int, list[tuple[bytes, bytes, str]]] | None:
        """A demotion without a copy: ``row`` (a pool row) holds ``key``'s block for ``owner``. The
        tier keeps that row and returns (the row the pool takes instead, blocks evicted to free
        it). A key already here is only touched, and the pool keeps its row. None when the block
        cannot come in this way (``owner`` may hold no host block, every row is reserved by disk
        reads): `put` then passes it on as bytes."""
        assert self.shared, "adopt needs a slab shared with the device pool"
        if key in self._index:
            self.touch(key)
            return row, []
        evicted = self._make_room(owner) if self._admits(owner) else None
        if evicted is None:
            return None
        spare = self._free.pop()
        if spare in self._unclean:
            self._unclean.discard(spare)
            self.slots[spare].zero_()
        self._index_slot(key, row, owner, copied=False)
        return spare, evicted

    def surrender(self, key: bytes, row: int) -> int | None:
        """A promotion without a copy: the row holding ``key``'s block goes to the pool, and
        ``row`` (the pool block's old row) becomes a free row of the tier. The block leaves this
        tier — the device holds it now, and demotes it again when evicting it. None on a miss."""
        assert self.shared, "surrender needs a slab shared with the device pool"
        held = self._index.get(key)
        if held is None:
            self.stats.misses += 1
            return None
        t0 = time.perf_counter()
        self.life.accessed(key)
        self.delete(key)
        self._free[-1] = row  # (delete freed `held` last: the pool's old row takes its place)
        self.stats.hits += 1
        self.stats.handovers += 1
        self.stats.read_time_s += time.perf_counter() - t0  # bookkeeping only: bytes_read stays
        return held

    def rows(self) -> set[int]:
        """Every row the tier owns (indexed, free, or reserved by a read)."""
        return set(self._index.values()) | set(self._free) | self._reserved

    def reserved_rows(self) -> set[int]:
        """Rows a disk or remote read is filling (see `reserve`)."""
        return set(self._reserved)

    def payload(self, key: bytes) -> bytes | None:
        slot = self._index.get(key)
        return None if slot is None else self.slots[slot].numpy().tobytes()

    def view(self, key: bytes) -> memoryview | None:
        """The block's bytes where they lie (no copy): valid only until the tier changes."""
        slot = self._index.get(key)
        return None if slot is None else self.slots[slot].numpy().data

    def slot_of(self, key: bytes) -> int | None:
        return self._index.get(key)

    def snapshot(self, key: bytes, slot: int) -> bytes | None:
        """A copy of ``key``'s block in ``slot``, made on a thread other than the step loop's;
        None if the block was not there for the whole copy (the step loop moved or evicted it,
        so the bytes may be torn). A block leaves a slot before anything else is written there."""
        left = self._left.get(slot, 0)
        if self._index.get(key) != slot:
            return None
        data = self.slots[slot].numpy().tobytes()
        if self._left.get(slot, 0) != left or self._index.get(key) != slot:
            return None
        return data

    def _leave(self, slot: int) -> None:
        self._left[slot] = self._left.get(slot, 0) + 1

    def delete(self, key: bytes) -> bool:
        slot = self._index.pop(key, None)
        if slot is None:
            return False
        self._leave(slot)
        self.policy.remove(key)
        self.ledger.remove(key)
        self.life.removed(key)
        self.events.removed(key)
        self._free.append(slot)
        return True

    def clear(self) -> int:
        keys = list(self._index)
        for key in keys:
            self.delete(key)
        return len(keys)

    def keys(self) -> Iterator[bytes]:
        return iter(list(self._index))

    def _make_room(self, owner: str, for_quota: bool = True) -> list[tuple[bytes, bytes, str]] | None:
        """Evict what one more block of ``owner`` needs — a block when no slot is free, or (with
        ``for_quota``) one of its own when it is at its quota — and return it; None when no slot
        can be had: every slot is reserved, or every block that could go is protected."""
        if not self._free and not self._index:
            return None
        if not self._free or for_quota and self.ledger.at_quota(owner):
            victim = self._evict_one(owner)
            if victim is None:
                return None if not self._free else []
            return [victim]
        return []

    def _pick(self, owner: str) -> bytes | None:
        """The policy's victim for ``owner``, passing over kept blocks while another candidate
        exists among the next `KEEP_SCAN` (those passed over go back in as just used, in their
        order); when none is found, the policy's own victim leaves. Protected blocks are never
        chosen: None when nothing else is left."""
        try:
            key: bytes = pick_victim(self.policy, self.ledger, owner)  # type: ignore[assignment]
        except AllProtected:
            return None
        if self.keep is None or not self.keep(key):
            return key
        passed = [key]
        while len(self.policy) and len(passed) < KEEP_SCAN:
            try:
                key = pick_victim(self.policy, self.ledger, owner)  # type: ignore[assignment]
            except AllProtected:
                key = passed.pop(0)
                break
            if not self.keep(key):
                self.kept += 1
                break
            passed.append(key)
        else:
            key = passed.pop(0)
        for spared in passed:
            self.policy.insert(spared)
        return key

    def _evict_one(self, owner: str) -> tuple[bytes, bytes, str] | None:
        key = self._pick(owner)
        if key is None:
            return None
        slot = self._index.pop(key)
        self._leave(slot)
        payload = self.slots[slot].numpy().tobytes()
        self._free.append(slot)
        self.life.removed(key)
        self.events.removed(key)
        self.stats.evictions += 1
        return key, payload, self.ledger.remove(key) or UNKNOWN

    def check_invariants(self) -> None:
        assert len(self._index) + len(self._free) + len(self._reserved) == self.capacity_blocks
        assert not self._reserved & set(self._free) and not self._reserved & set(self._index.values())
        assert len(set(self._index.values())) == len(self._index)
        assert len(set(self._free)) == len(self._free)
        assert self._unclean <= set(self._free) | self._reserved
        assert not set(self._index.values()) & set(self._free)
        assert len(self.policy) == len(self._index), (len(self.policy), len(self._index))
        assert len(self.ledger) == len(self._index), (len(self.ledger), len(self._index))
