"""What every tier below the device pool declares and answers, whatever holds its blocks.

A tier says *what it is* through `TierTraits` (where its blocks live, what they outlive, what
holds them, whether other replicas reach them, and which part of the chain's data path it takes)
and *how it is doing* through the counters and `describe()`. Everything above the tiers — the
chain's snapshot, the archetype classifier, `/admin/metrics`, Prometheus, the dashboard — reads
these and never a tier's name, so a new kind of tier is one module plus its entry in
`cache.tiers.factory`.

The chain moves blocks through three roles:

- ``memory``: byte-addressable slots the device copies from and the lower tiers read into;
- ``store``: a local store with an exact index (`in` answers without I/O), read in batches with a
  deadline and written by the chain's writer threads;
- ``shared``: a store other replicas reach, asked which blocks it holds (`exists`) before a load.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any, Literal, Protocol, runtime_checkable

from cache.telemetry import BlockLife
from cache.tiers.codec import BlockFormat
from cache.tiers.stats import RateEstimate, TierStats

Role = Literal["memory", "store", "shared"]
Lifetime = Literal["session", "persistent"]
ROLES: tuple[Role, ...] = ("memory", "store", "shared")


@dataclass(frozen=True, slots=True)
class TierTraits:
    """A tier's place on the survey's axes (cache.archetype) and in the chain's data path.

    ``locality``: where the blocks are, as the archetype names it ("host", "node-ssd", "remote");
    ``lifetime``: what they outlive ("session": the process; "persistent": a restart);
    ``substrate``: the medium ("host-dram", "nvme-fs", "network"); ``shared``: other replicas
    read and write the same blocks (ownership is then shared); ``role``: see the module docstring.
    """

    locality: str
    lifetime: Lifetime
    substrate: str
    shared: bool
    role: Role

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        if self.lifetime not in ("session", "persistent"):
            raise ValueError(f"lifetime must be session or persistent, got {self.lifetime!r}")

    def to_dict(self) -> dict[str, Any]:
        return {"locality": self.locality, "lifetime": self.lifetime, "substrate": self.substrate,
                "shared": self.shared, "role": self.role}


@runtime_checkable
class Tier(Protocol):
    """What the chain, its snapshot and its consumers read from every tier."""

    name: str
    traits: TierTraits
    stats: TierStats
    rate: RateEstimate  # the declared cost model: load bytes/s and per-operation latency, kept current
    life: BlockLife
    capacity_blocks: int
    policy_name: str

    def __len__(self) -> int: ...

    @property
    def nbytes(self) -> int: ...

    def describe(self) -> dict[str, Any]:
        """Tier-specific state for the snapshot (a folder, a URL, a breaker, health)."""
        ...

    def apply_quota(self, owner: str, tag: str, blocks: int | None) -> None:
        """Hold at most ``blocks`` of ``owner``'s blocks (None: no limit); ``tag`` names the owner
        where a store must not see its name."""
        ...


@runtime_checkable
class StoreTier(Tier, Protocol):
    """A ``store`` tier: exact local index, batched reads into given buffers, one write per block."""

    fmt: BlockFormat
    load_timeout_s: float
    ledger: Any  # cache.quota.QuotaLedger: who holds what, and whether an owner may write more

    def __contains__(self, key: bytes) -> bool: ...

    def touch(self, key: bytes) -> bool: ...

    def delete(self, key: bytes) -> bool: ...

    def health(self) -> str | None: ...

    def note_stall(self, blocks: int) -> None: ...

    async def read_many(self, keys: Sequence[bytes], into: Sequence[memoryview | None] | None = None
                        ) -> list[memoryview | None]: ...

    async def write(self, key: bytes, payload: bytes | memoryview, owner: str = ...,
                    executor: Executor | None = None) -> bool: ...


@runtime_checkable
class SharedTier(Tier, Protocol):
    """A ``shared`` tier: existence checks, pipelined gets into given buffers, batched puts."""

    fmt: BlockFormat
    write_executor: Executor | None
    unstored: Any  # a deque of keys whose write failed or were dropped: sent again when asked

    async def exists(self, keys: Sequence[bytes]) -> list[bool]: ...

    async def get(self, keys: Sequence[bytes], dests: Sequence[memoryview | None] = ()
                  ) -> list[memoryview | None]: ...

    async def put(self, items: Sequence[tuple[bytes, bytes]], owner: str = ...) -> int: ...

    async def close(self) -> None: ...
