"""Which KV-cache archetype a running configuration is, on the survey's four axes.

The survey "From Tensor Buffer to Distributed Memory Hierarchy" (2026) sorts KV-cache systems
into five archetypes by where blocks live (locality), what they outlive (lifetime), who decides
their placement (ownership) and what holds them (substrate). KVGate can be several of them: the
tiers below the device pool are attached, detached and can fail while serving, so the answer is
computed from what the engine reports now (``TierChain.snapshot()`` plus a few engine facts),
never fixed in code or configuration.

Rules, first match wins (docs/archetype.md has the table):

1. ``disaggregated`` → **Disaggregated-Pipeline**. Shipping KV from a prefill engine to a decode
   engine is the defining data path; whatever tiers each engine has sits beside it.
2. ``central_manager`` → **Memory-Pool**. When a pool service owns placement, the engine's own
   tiers are its clients, not its design.
3. Otherwise only *active* tiers decide: enabled, healthy, and — below the device — reachable by
   the prefix cache (with prefix caching off nothing is published, so nothing is demoted to or
   promoted from any tier; they are inert).
   - device only → **Local-Paged** (lifetime "request" when prefix caching is off);
   - a remote store and no local tier below the device → **Shared-Store**;
   - host and/or disk below the device, with or without a remote → **Hybrid-Tier**.

A tier that is configured but down (the remote's circuit breaker open or half-open) or inert is
left out of the decision — KVGate serves without it, so calling it e.g. Shared-Store would
describe a store no request can reach — but it is still listed under ``tiers`` and named in
``reason``. Ownership is its own axis, decided apart from the name: central manager if there is
one, else shared through the remote store while that store is healthy, else engine-owned.

Only the standard library is imported (nothing from engine/ or app/, not even torch): the engine
passes plain values in, so this runs anywhere the stats dict can be read.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, cast

ArchetypeName = Literal["Local-Paged", "Disaggregated-Pipeline", "Shared-Store", "Memory-Pool", "Hybrid-Tier"]
TierName = Literal["device", "host", "disk", "remote"]
DeviceKind = Literal["cpu", "cuda"]
Lifetime = Literal["request", "session", "persistent"]

ARCHETYPES: tuple[ArchetypeName, ...] = (
    "Local-Paged", "Disaggregated-Pipeline", "Shared-Store", "Memory-Pool", "Hybrid-Tier")
TIER_ORDER: tuple[TierName, ...] = ("device", "host", "disk", "remote")
LIFETIME_ORDER: tuple[Lifetime, ...] = ("request", "session", "persistent")

ENGINE_OWNED = "engine-owned"
SHARED_OWNED = "shared by replicas through the remote store"
CENTRAL_OWNED = "central manager"

#: The survey's locality levels, by tier (the disk tier is a folder KVGate assumes is node-local).
LOCALITY: Mapping[TierName, str] = {"device": "device", "host": "host", "disk": "node-ssd", "remote": "remote"}

#: What outlives what: host memory lives as long as the process (the session), disk files are
#: re-indexed after a restart, remote records outlive any one replica until their TTL.
_LIFETIME: Mapping[TierName, Lifetime] = {"host": "session", "disk": "persistent", "remote": "persistent"}

#: Stats keys worth carrying into ``detail`` (the rest stays in /admin/metrics).
_DETAIL_KEYS = ("blocks", "capacity_blocks", "policy", "path", "url", "breaker", "breaker_trips", "write",
                "unhealthy_reason")


def substrate_of(tier: TierName, device_kind: DeviceKind) -> str:
    """The medium holding a tier's blocks. On a CPU engine the device pool is CPU RAM: the same
    DRAM as the host tier, which is why the two are told apart by tier and not by speed."""
    if tier == "device":
        return "gpu-hbm" if device_kind == "cuda" else "cpu-ram"
    return {"host": "host-dram", "disk": "nvme-fs", "remote": "network"}[tier]


def lifetime_of(tier: TierName, prefix_caching: bool) -> Lifetime:
    """How long a block in ``tier`` can be reused. Without prefix caching a device block is freed
    with its request; with it, later requests of the same process reuse it."""
    if tier == "device":
        return "session" if prefix_caching else "request"
    return _LIFETIME[tier]


@dataclass(frozen=True, slots=True)
class TierView:
    """One tier as configured now. ``enabled``: attached; ``healthy``: answering (a tier that is
    attached but unhealthy is served around, so it must not decide the archetype)."""

    name: TierName
    enabled: bool
    healthy: bool = True
    capacity_bytes: int | None = None
    detail: Mapping[str, Any] = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        if self.name not in TIER_ORDER:
            raise ValueError(f"tier must be one of {TIER_ORDER}, got {self.name!r}")

    @property
    def down_note(self) -> str:
        """Why this tier is left out, for the reason sentence."""
        breaker = self.detail.get("breaker")
        if self.name == "remote" and breaker not in (None, "closed"):
            return f"remote tier configured but unreachable (circuit {breaker})"
        why = self.detail.get("unhealthy_reason")
        return f"{self.name} tier configured but down" + (f" ({why})" if why else "")


@dataclass(frozen=True, slots=True)
class HierarchyView:
    """The live configuration to classify: engine facts plus one view per tier.

    ``disaggregated`` and ``central_manager`` are features KVGate does not have; they are here so
    that a table of other systems' configurations can be classified with the same rules.
    """

    device_kind: DeviceKind
    prefix_caching: bool
    tiers: tuple[TierView, ...] = ()
    remote_cluster: bool = False
    disaggregated: bool = False
    central_manager: bool = False

    def __post_init__(self) -> None:
        if self.device_kind not in ("cpu", "cuda"):
            raise ValueError(f"device_kind must be 'cpu' or 'cuda', got {self.device_kind!r}")
        names = [t.name for t in self.tiers]
        if len(names) != len(set(names)):
            raise ValueError(f"each tier at most once, got {names}")
        by_name = {t.name: t for t in self.tiers}
        device = by_name.get("device")
        if device is not None and not (device.enabled and device.healthy):
            raise ValueError("the device pool is always enabled and healthy: the engine cannot serve without it")
        # every tier present, in hierarchy order, so reports have one shape whatever was passed
        full = tuple(by_name.get(n) or TierView(n, enabled=n == "device") for n in TIER_ORDER)
        object.__setattr__(self, "tiers", full)

    def tier(self, name: TierName) -> TierView:
        return next(t for t in self.tiers if t.name == name)

    def active(self, view: TierView) -> bool:
        """Whether ``view`` holds reusable KV now: attached, healthy and, below the device, fed by
        the prefix cache (without it no block is published, so none is demoted or promoted)."""
        if not (view.enabled and view.healthy):
            return False
        return view.name == "device" or self.prefix_caching


@dataclass(frozen=True, slots=True)
class TierReport:
    """One tier in the answer: what it is, and whether it took part in the decision."""

    enabled: bool
    healthy: bool
    active: bool
    locality: str
    substrate: str
    lifetime: Lifetime
    capacity_bytes: int | None
    detail: Mapping[str, Any] = field(default_factory=dict, hash=False)

    def to_dict(self) -> dict[str, Any]:
        return {"enabled": self.enabled, "healthy": self.healthy, "active": self.active,
                "locality": self.locality, "substrate": self.substrate, "lifetime": self.lifetime,
                "capacity_bytes": self.capacity_bytes, "detail": dict(self.detail)}


@dataclass(frozen=True, slots=True)
class Axes:
    """The survey's four axes, over the active tiers only."""

    locality: tuple[str, ...]
    lifetime: Lifetime
    lifetime_per_tier: Mapping[str, Lifetime] = field(hash=False)
    ownership: str
    substrate: tuple[str, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"locality": list(self.locality),
                "lifetime": {"longest": self.lifetime, "per_tier": dict(self.lifetime_per_tier)},
                "ownership": self.ownership, "substrate": list(self.substrate)}


@dataclass(frozen=True, slots=True)
class Archetype:
    name: ArchetypeName
    reason: str
    axes: Axes
    tiers: Mapping[str, TierReport] = field(hash=False)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready values (lists, dicts, strings, numbers, booleans, None)."""
        return {"name": self.name, "reason": self.reason, "axes": self.axes.to_dict(),
                "tiers": {name: report.to_dict() for name, report in self.tiers.items()}}


def _join(words: Iterable[str]) -> str:
    items = list(words)
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def classify(view: HierarchyView) -> Archetype:
    """Apply the rules in the module docstring to ``view``; pure, and total over valid views."""
    active = [t for t in view.tiers if view.active(t)]
    names = {t.name for t in active}
    below = [n for n in ("host", "disk") if n in names]
    remote = "remote" in names

    if view.disaggregated:
        name: ArchetypeName = "Disaggregated-Pipeline"
        why = "prefill and decode run on separate engines with KV shipped between them"
    elif view.central_manager:
        name, why = "Memory-Pool", "a central manager owns block placement"
    elif below:
        name = "Hybrid-Tier"
        why = f"{_join(below)} below the device" + (", plus a remote store shared by replicas" if remote else "")
    elif remote:
        name, why = "Shared-Store", "a remote store shared by replicas and no local tier below the device"
    else:
        name = "Local-Paged"
        why = ("only the device pool holds KV, reused across requests" if view.prefix_caching
               else "only the device pool holds KV and prefix caching is off, so blocks die with their request")

    notes = [t.down_note for t in view.tiers if t.enabled and not t.healthy]
    inert = [t.name for t in view.tiers if t.enabled and t.healthy and not view.active(t)]
    if inert:
        notes.append(f"{_join(inert)} tier{'s' if len(inert) > 1 else ''} attached but inert (prefix caching off)")
    where = _join("remote Redis Cluster" if t.name == "remote" and view.remote_cluster else t.name for t in active)
    reason = f"serving as {name} on {where} ({why})"
    if notes:
        reason = "; ".join(notes) + ": " + reason

    if view.central_manager:
        ownership = CENTRAL_OWNED
    elif remote:
        ownership = SHARED_OWNED
    else:
        ownership = ENGINE_OWNED
    per_tier: dict[str, Lifetime] = {t.name: lifetime_of(t.name, view.prefix_caching) for t in active}
    substrate = [substrate_of(t.name, view.device_kind) for t in active]
    if view.disaggregated and "network" not in substrate:
        substrate.append("network")  # the prefill→decode transfer crosses it
    axes = Axes(locality=tuple(LOCALITY[t.name] for t in active),
                lifetime=max(per_tier.values(), key=LIFETIME_ORDER.index),
                lifetime_per_tier=per_tier, ownership=ownership, substrate=tuple(substrate))
    reports: dict[str, TierReport] = {
        t.name: TierReport(enabled=t.enabled, healthy=t.enabled and t.healthy, active=view.active(t),
                           locality=LOCALITY[t.name], substrate=substrate_of(t.name, view.device_kind),
                           lifetime=lifetime_of(t.name, view.prefix_caching),
                           capacity_bytes=t.capacity_bytes, detail=t.detail)
        for t in view.tiers}
    return Archetype(name=name, reason=reason, axes=axes, tiers=reports)


def _tier_from_stats(name: TierName, stats: Mapping[str, Any], capacity: int | None, cluster: bool) -> TierView:
    """A TierView from one entry of ``TierChain.snapshot()``. Health: the remote tier's circuit
    breaker ("half-open" is still unconfirmed, so not healthy), and a tier's own ``healthy`` where
    it reports one (the disk: its folder is gone for good, or every reader is stuck); otherwise
    errors are counted while the tier keeps serving, so attached means healthy."""
    detail = {k: stats[k] for k in _DETAIL_KEYS if k in stats and stats[k] is not None}
    if name == "remote":  # its block counts are always 0 (unknown without a scan): not worth showing
        detail = {k: v for k, v in detail.items() if k not in ("blocks", "capacity_blocks")}
        detail["cluster"] = cluster
    healthy = stats.get("breaker", "closed") == "closed" and stats.get("healthy", True) is not False
    if capacity is None:
        # snapshot() has used bytes and blocks but not the block size: derive it once a block is in
        blocks, used, cap = stats.get("blocks") or 0, stats.get("bytes") or 0, stats.get("capacity_blocks") or 0
        if blocks > 0 and cap > 0:
            capacity = used // blocks * cap
    return TierView(name, enabled=True, healthy=healthy, capacity_bytes=capacity, detail=detail)


def describe(device_kind: str, prefix_caching: bool, tiers_stats: Mapping[str, Any] | None = None,
             remote_cluster: bool = False, *, capacity_bytes: Mapping[str, int | None] | None = None,
             disaggregated: bool = False, central_manager: bool = False) -> HierarchyView:
    """Build the view from what the engine process has at hand.

    ``device_kind``: the torch device type ("cpu", "cuda" or "cuda:N"); ``tiers_stats``: the dict
    ``TierChain.snapshot()`` returns (``{}`` or None without a chain) — a tier is enabled when its
    key is there; ``capacity_bytes``: optional sizes by tier name (the engine knows the device
    pool's and the configured host/disk sizes; otherwise derived from the stats when possible).
    """
    kind = device_kind.split(":", 1)[0]
    if kind not in ("cpu", "cuda"):
        raise ValueError(f"device_kind must be cpu, cuda or cuda:N, got {device_kind!r}")
    stats = tiers_stats or {}
    sizes = capacity_bytes or {}
    views = [TierView("device", enabled=True, capacity_bytes=sizes.get("device"))]
    for name in ("host", "disk", "remote"):
        entry = stats.get(name)
        if isinstance(entry, Mapping):
            views.append(_tier_from_stats(cast(TierName, name), entry, sizes.get(name), remote_cluster))
    return HierarchyView(cast(DeviceKind, kind), bool(prefix_caching), tuple(views), bool(remote_cluster),
                         bool(disaggregated), bool(central_manager))
