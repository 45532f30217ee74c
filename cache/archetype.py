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
   - a shared store (a tier that declares ``shared``) and no local tier below the device →
     **Shared-Store**;
   - any local tier below the device, with or without a shared store → **Hybrid-Tier**.

Tiers are read by what they declare (locality, lifetime, substrate, shared: `TierTraits`), never
by name, so a new kind of tier is classified without a change here. A tier that is attached but
down (a circuit breaker open or half-open, a folder gone) or inert is left out of the decision —
KVGate serves without it, so calling it e.g. Shared-Store would describe a store no request can
reach — but it is still listed under ``tiers`` and named in ``reason``; a detached tier is not
listed. Ownership is its own axis: central manager if there is one, else shared while a shared
store is active, else engine-owned.

Only the standard library is imported (nothing from engine/ or app/, not even torch): the engine
passes plain values in, so this runs anywhere the stats dict can be read.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, cast

ArchetypeName = Literal["Local-Paged", "Disaggregated-Pipeline", "Shared-Store", "Memory-Pool", "Hybrid-Tier"]
DeviceKind = Literal["cpu", "cuda"]
Lifetime = Literal["request", "session", "persistent"]

ARCHETYPES: tuple[ArchetypeName, ...] = (
    "Local-Paged", "Disaggregated-Pipeline", "Shared-Store", "Memory-Pool", "Hybrid-Tier")
LIFETIME_ORDER: tuple[Lifetime, ...] = ("request", "session", "persistent")
DEVICE = "device"  # the engine's own pool: always there, first, and not a tier of the chain

ENGINE_OWNED = "engine-owned"
SHARED_OWNED = "shared by replicas through the remote store"
CENTRAL_OWNED = "central manager"

#: Stats keys worth carrying into ``detail`` (the rest stays in /admin/metrics).
_DETAIL_KEYS = ("blocks", "capacity_blocks", "policy", "path", "url", "cluster", "breaker", "breaker_trips", "write",
                "unhealthy_reason")


def device_substrate(device_kind: DeviceKind) -> str:
    """The medium of the device pool. On a CPU engine it is CPU RAM: the same DRAM as a host
    tier, which is why tiers are told apart by what they declare and not by speed."""
    return "gpu-hbm" if device_kind == "cuda" else "cpu-ram"


@dataclass(frozen=True, slots=True)
class TierView:
    """One tier as configured now, with what it declares of itself (`cache.tiers.base.TierTraits`):
    ``locality``, ``lifetime``, ``substrate`` and ``shared`` (other replicas reach its blocks).
    ``enabled``: attached; ``healthy``: answering (a tier that is attached but unhealthy is served
    around, so it must not decide the archetype). The device pool is the view named "device"."""

    name: str
    enabled: bool
    healthy: bool = True
    capacity_bytes: int | None = None
    detail: Mapping[str, Any] = field(default_factory=dict, hash=False)
    locality: str = ""
    lifetime: Lifetime = "session"
    substrate: str = ""
    shared: bool = False
    label: str = ""  # how the reason names it (default: its name)

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("a tier needs a name")
        if self.lifetime not in LIFETIME_ORDER:
            raise ValueError(f"lifetime must be one of {LIFETIME_ORDER}, got {self.lifetime!r}")

    @property
    def down_note(self) -> str:
        """Why this tier is left out, for the reason sentence."""
        breaker = self.detail.get("breaker")
        if breaker not in (None, "closed"):
            return f"{self.name} tier configured but unreachable (circuit {breaker})"
        why = self.detail.get("unhealthy_reason")
        return f"{self.name} tier configured but down" + (f" ({why})" if why else "")


@dataclass(frozen=True, slots=True)
class HierarchyView:
    """The live configuration to classify: engine facts plus one view per tier, top down.

    ``disaggregated``: prefill and decode run on separate engines (``role`` says which side this
    one is: "prefill" or "decode"); ``central_manager`` is a feature KVGate does not have, here so
    that a table of other systems' configurations can be classified with the same rules.
    """

    device_kind: DeviceKind
    prefix_caching: bool
    tiers: tuple[TierView, ...] = ()
    disaggregated: bool = False
    central_manager: bool = False
    role: str = ""

    def __post_init__(self) -> None:
        if self.device_kind not in ("cpu", "cuda"):
            raise ValueError(f"device_kind must be 'cpu' or 'cuda', got {self.device_kind!r}")
        names = [t.name for t in self.tiers]
        if len(names) != len(set(names)):
            raise ValueError(f"each tier at most once, got {names}")
        device = next((t for t in self.tiers if t.name == DEVICE), None)
        if device is not None and not (device.enabled and device.healthy):
            raise ValueError("the device pool is always enabled and healthy: the engine cannot serve without it")
        # the device pool first, with its own traits, whatever was passed
        pool = TierView(DEVICE, True, capacity_bytes=device.capacity_bytes if device is not None else None,
                        detail=device.detail if device is not None else {}, locality="device",
                        lifetime="session" if self.prefix_caching else "request",
                        substrate=device_substrate(self.device_kind))
        object.__setattr__(self, "tiers", (pool, *(t for t in self.tiers if t.name != DEVICE)))

    def tier(self, name: str) -> TierView:
        return next(t for t in self.tiers if t.name == name)

    def active(self, view: TierView) -> bool:
        """Whether ``view`` holds reusable KV now: attached, healthy and, below the device, fed by
        the prefix cache (without it no block is published, so none is demoted or promoted)."""
        if not (view.enabled and view.healthy):
            return False
        return view.name == DEVICE or self.prefix_caching


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
    below = [t.name for t in active if t.name != DEVICE and not t.shared]
    shared = any(t.shared for t in active)

    if view.disaggregated:
        name: ArchetypeName = "Disaggregated-Pipeline"
        why = "prefill and decode run on separate engines with KV shipped between them"
        if view.role == "prefill":
            why += "; this is a prefill engine: its prompts' blocks go to the shared store for decode engines"
        elif view.role == "decode":
            why += "; this is a decode engine: prompts' blocks come from the shared store, written by prefill engines"
    elif view.central_manager:
        name, why = "Memory-Pool", "a central manager owns block placement"
    elif below:
        name = "Hybrid-Tier"
        why = f"{_join(below)} below the device" + (", plus a remote store shared by replicas" if shared else "")
    elif shared:
        name, why = "Shared-Store", "a remote store shared by replicas and no local tier below the device"
    else:
        name = "Local-Paged"
        why = ("only the device pool holds KV, reused across requests" if view.prefix_caching
               else "only the device pool holds KV and prefix caching is off, so blocks die with their request")

    notes = [t.down_note for t in view.tiers if t.enabled and not t.healthy]
    inert = [t.name for t in view.tiers if t.enabled and t.healthy and not view.active(t)]
    if inert:
        notes.append(f"{_join(inert)} tier{'s' if len(inert) > 1 else ''} attached but inert (prefix caching off)")
    where = _join(t.label or t.name for t in active)
    reason = f"serving as {name} on {where} ({why})"
    if notes:
        reason = "; ".join(notes) + ": " + reason

    if view.central_manager:
        ownership = CENTRAL_OWNED
    elif shared:
        ownership = SHARED_OWNED
    else:
        ownership = ENGINE_OWNED
    per_tier: dict[str, Lifetime] = {t.name: t.lifetime for t in active}
    substrate = [t.substrate for t in active]
    if view.disaggregated and "network" not in substrate:
        substrate.append("network")  # the prefill→decode transfer crosses it
    axes = Axes(locality=tuple(t.locality for t in active),
                lifetime=max(per_tier.values(), key=LIFETIME_ORDER.index),
                lifetime_per_tier=per_tier, ownership=ownership, substrate=tuple(substrate))
    reports: dict[str, TierReport] = {
        t.name: TierReport(enabled=t.enabled, healthy=t.enabled and t.healthy, active=view.active(t),
                           locality=t.locality, substrate=t.substrate, lifetime=t.lifetime,
                           capacity_bytes=t.capacity_bytes, detail=t.detail)
        for t in view.tiers}
    return Archetype(name=name, reason=reason, axes=axes, tiers=reports)


def _tier_from_stats(name: str, stats: Mapping[str, Any], capacity: int | None) -> TierView:
    """A TierView from one entry of ``TierChain.snapshot()``: its declared ``traits``, and health
    from its circuit breaker, where it has one ("half-open" is still unconfirmed, so not healthy),
    and its own ``healthy`` where it reports one; otherwise errors are counted while the tier
    keeps serving, so attached means healthy."""
    traits = stats["traits"]
    detail = {k: stats[k] for k in _DETAIL_KEYS if k in stats and stats[k] is not None}
    if not stats.get("capacity_blocks"):  # bounded outside KVGate (a store's own memory, a TTL): counts unknown
        detail = {k: v for k, v in detail.items() if k not in ("blocks", "capacity_blocks")}
    healthy = stats.get("breaker", "closed") == "closed" and stats.get("healthy", True) is not False
    if capacity is None:
        # snapshot() has used bytes and blocks but not the block size: derive it once a block is in
        blocks, used, cap = stats.get("blocks") or 0, stats.get("bytes") or 0, stats.get("capacity_blocks") or 0
        if blocks > 0 and cap > 0:
            capacity = used // blocks * cap
    return TierView(name, enabled=True, healthy=healthy, capacity_bytes=capacity, detail=detail,
                    locality=traits["locality"], lifetime=traits["lifetime"], substrate=traits["substrate"],
                    shared=bool(traits["shared"]), label=str(stats.get("label") or ""))


def describe(device_kind: str, prefix_caching: bool, tiers_stats: Mapping[str, Any] | None = None, *,
             capacity_bytes: Mapping[str, int | None] | None = None,
             disaggregated: bool = False, central_manager: bool = False, role: str = "") -> HierarchyView:
    """Build the view from what the engine process has at hand.

    ``device_kind``: the torch device type ("cpu", "cuda" or "cuda:N"); ``tiers_stats``: the dict
    ``TierChain.snapshot()`` returns (``{}`` or None without a chain) — every entry with
    ``traits`` is an attached tier, in order; ``capacity_bytes``: optional sizes by tier name (the
    engine knows the device pool's and the tiers' sizes; otherwise derived from the stats when
    possible).
    """
    kind = device_kind.split(":", 1)[0]
    if kind not in ("cpu", "cuda"):
        raise ValueError(f"device_kind must be cpu, cuda or cuda:N, got {device_kind!r}")
    stats = tiers_stats or {}
    sizes = capacity_bytes or {}
    views = [TierView(DEVICE, enabled=True, capacity_bytes=sizes.get(DEVICE))]
    for name, entry in stats.items():
        if isinstance(entry, Mapping) and isinstance(entry.get("traits"), Mapping):
            views.append(_tier_from_stats(name, entry, sizes.get(name)))
    return HierarchyView(cast(DeviceKind, kind), bool(prefix_caching), tuple(views), bool(disaggregated),
                         bool(central_manager), role)
