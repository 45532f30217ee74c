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
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

from cache.telemetry import BlockLife
from cache.tiers.stats import RateEstimate, TierStats

if TYPE_CHECKING:
    from cache.tiers.codec import BlockFormat

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


def _doc(text: str, default: Any = None) -> Any:
    return field(default=default, metadata={"doc": text})


@dataclass(frozen=True, slots=True)
class TierSnapshot:
    """One attached tier in `TierChain.snapshot()`; serialised flat (`to_dict`): the counters and
    what the tier describes of itself sit beside the other fields."""

    counters: dict[str, Any] = _doc("every `TierStats` counter, flat: hits, misses, puts, evictions, "
                                    "bytes_read, bytes_written, reads, writes, read_time_s, write_time_s, "
                                    "errors, corrupt, dropped, metadata_bytes, handovers, timeouts, lost, "
                                    "undecodable, unauthentic (bytes count records as stored: encoded)")
    blocks: int = _doc("blocks the tier holds (0 where it cannot know without a scan)", 0)
    capacity_blocks: int = _doc("blocks it can hold (0: bounded outside KVGate, e.g. Redis memory and TTL)", 0)
    bytes: int = _doc("bytes it holds", 0)
    policy: str = _doc("its eviction policy (lru, s3fifo, ttl, ...)", "")
    load_bytes_per_s: float = _doc("load-rate estimate: bytes per second", 0.0)
    load_latency_s: float = _doc("load-rate estimate: seconds per operation", 0.0)
    load_samples: int = _doc("loads observed", 0)
    load_sample_age_s: float | None = _doc("seconds since the last load observed", None)
    traits: dict[str, Any] = _doc("what it declares: locality, lifetime, substrate, shared, role", None)
    detail: dict[str, Any] = _doc("what `describe()` adds, flat: e.g. path, healthy, url, breaker, write, quota, codec", None)

    @classmethod
    def of(cls, tier: Tier) -> TierSnapshot:
        detail = tier.describe()  # first: a tier may recover (a disk folder) while it looks
        return cls(counters=tier.stats.snapshot(), blocks=len(tier), capacity_blocks=tier.capacity_blocks,
                   bytes=tier.nbytes, policy=tier.policy_name, load_bytes_per_s=tier.rate.bytes_per_s,
                   load_latency_s=tier.rate.latency_s, load_samples=tier.rate.samples,
                   load_sample_age_s=tier.rate.age_s(), traits=tier.traits.to_dict(), detail=detail)

    def to_dict(self) -> dict[str, Any]:
        out = {**self.counters}
        out.update({f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("counters", "detail")})
        out.update(self.detail or {})
        return out
