"""Every kind of tier KVGate can attach, its options and how it is built: the one place that
knows tiers by name.

A kind is a pydantic model of its options (the one validation they get: the server's
configuration and `POST /admin/tiers` both come through it), a builder, and optionally a check
the API process runs before an attach (`preflight`, e.g. whether a store answers), so the engine's
step loop never waits on the network for it. `register` adds a kind (tests add one of their own;
nothing else in the project needs to change for it to appear in the chain, the archetype,
`/admin/metrics` and Prometheus).

The built-in kinds' options live in cache/tiers/options.py and their implementations are imported
by the builders, in the engine process: validating options (the configuration loader, the API
process) imports neither torch nor a tier.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ValidationError

from cache.tiers.options import DiskOptions, HostOptions, RemoteOptions, reach_store, safe_url

if TYPE_CHECKING:
    import torch

    from cache.tiers.base import Tier
    from cache.tiers.codec import BlockFormat
    from cache.tiers.disk import DiskTier
    from cache.tiers.host import HostTier
    from cache.tiers.remote import RemoteTier


class RowBank:
    """Rows of the device pool's KV tensor that no device block owns, lent to a memory tier that
    shares the tensor (`HostTier` with a slab) and taken back when it leaves. With the pool's
    blocks and the attached tier, every row has exactly one owner: `owners` lists the bank's part."""

    def __init__(self, slab: torch.Tensor | None, rows: list[int]) -> None:
        self.slab = slab
        self.spare = list(rows)
        self.orphans: set[int] = set()  # rows a detached tier's reads were still filling

    def take(self, n: int) -> list[int] | None:
        """``n`` spare rows, or None (and nothing taken) when the bank has fewer."""
        if self.slab is None or not 0 < n <= len(self.spare):
            return None
        taken, self.spare = self.spare[:n], self.spare[n:]
        return taken

    def give_back(self, free: set[int], busy: set[int]) -> None:
        """A tier left: its ``free`` rows are spare again; ``busy`` ones a read may still write."""
        self.spare += sorted(free)
        self.orphans |= busy

    def owners(self) -> list[int]:
        return self.spare + sorted(self.orphans)


@dataclass(frozen=True, slots=True)
class BuildContext:
    """What a builder needs from the engine: the block layout and where host memory comes from."""

    fmt: BlockFormat
    block_nbytes: int
    policy: str = "lru"
    pin_memory: bool = False  # host slots in pinned memory (CUDA)
    rows: RowBank | None = None
    allowed_root: str | None = None  # where a folder named over HTTP may lie
    trusted: bool = True  # False: the options came over HTTP


def _host(options: HostOptions, ctx: BuildContext) -> HostTier:
    from cache.tiers.host import HostTier

    capacity = options.capacity_mb << 20
    taken = ctx.rows.take(capacity // ctx.block_nbytes) if ctx.rows is not None else None
    if taken is not None:  # room in the pool's own tensor: trade rows, copy nothing
        return HostTier(capacity, ctx.block_nbytes, ctx.policy, slab=ctx.rows.slab, rows=taken)  # type: ignore[union-attr]
    return HostTier(capacity, ctx.block_nbytes, ctx.policy, pin=ctx.pin_memory)


def _disk(options: DiskOptions, ctx: BuildContext) -> DiskTier:
    from cache.tiers.disk import DiskTier
    from cache.tiers.folders import attachable_folder

    path = options.path if ctx.trusted else str(attachable_folder(options.path, ctx.allowed_root))
    return DiskTier(path, options.capacity_mb << 20, ctx.fmt, ctx.policy, load_timeout_s=options.load_timeout_s,
                    codec=options.codec)


def _remote(options: RemoteOptions, ctx: BuildContext) -> RemoteTier:
    from cache.tiers.remote import RemoteTier

    if options.mac_key is None:
        raise ValueError("the remote tier needs the store's MAC key (mac_key: tenants.registry.store_mac_key "
                         "of the server secret, the same on every replica)")
    return RemoteTier(options.url, ctx.fmt, options.ttl_s, options.cluster, options.timeout_s, write_mode=options.write,
                      codec=options.codec, mac_key=options.mac_key)


async def _reach(options: RemoteOptions) -> str | None:
    problem = await reach_store(options.url, options.cluster)
    return None if problem is None else f"cannot reach the remote store {safe_url(options.url)}: {problem}"


@dataclass(frozen=True, slots=True)
class TierKind:
    name: str
    options: type[BaseModel]
    build: Callable[[Any, BuildContext], Tier]
    preflight: Callable[[Any], Awaitable[str | None]] | None = None
    http_fields: frozenset[str] = frozenset()  # options `POST /admin/tiers` may set (the rest: config only)


KINDS: dict[str, TierKind] = {}


def register(kind: TierKind) -> None:
    """Make ``kind`` attachable by its name (a second registration of a name replaces the first)."""
    KINDS[kind.name] = kind


def unregister(name: str) -> None:
    KINDS.pop(name, None)


register(TierKind("host", HostOptions, _host, http_fields=frozenset({"capacity_mb"})))
register(TierKind("disk", DiskOptions, _disk, http_fields=frozenset({"path", "capacity_mb", "codec"})))
register(TierKind("remote", RemoteOptions, _remote, _reach,
                  http_fields=frozenset({"url", "cluster", "ttl_s", "write", "codec"})))


def kind_of(name: str) -> TierKind:
    kind = KINDS.get(name)
    if kind is None:
        raise ValueError(f"unknown tier {name!r}; use {', '.join(KINDS)}")
    return kind


def validate(name: str, configured: Mapping[str, Any], overrides: Mapping[str, Any] | None = None) -> BaseModel:
    """The options of tier ``name``: ``configured`` (the server's configuration) with ``overrides``
    (a request's) on top; ValueError saying what is wrong. Overrides are limited to the kind's
    `http_fields`."""
    kind = kind_of(name)
    overrides = dict(overrides or {})
    unknown = set(overrides) - kind.http_fields
    if unknown:
        raise ValueError(f"unknown option(s) for the {name} tier: {', '.join(sorted(unknown))}; "
                         f"allowed: {', '.join(sorted(kind.http_fields)) or 'none'}")
    try:
        return kind.options.model_validate({**configured, **overrides})
    except ValidationError as exc:
        raise ValueError(_explain(name, exc)) from None


def build(name: str, options: BaseModel, ctx: BuildContext) -> Tier:
    """A new tier of kind ``name`` from validated ``options``; ValueError or OSError if it cannot be."""
    return kind_of(name).build(options, ctx)


async def preflight(name: str, options: BaseModel) -> str | None:
    """Why the tier cannot be attached as configured (a line), or None; asked off the step loop."""
    kind = kind_of(name)
    return await kind.preflight(options) if kind.preflight is not None else None


def _explain(name: str, exc: ValidationError) -> str:
    parts = []
    for error in exc.errors():
        field = ".".join(str(p) for p in error["loc"]) or "options"
        message = str(error["msg"]).removeprefix("Value error, ")
        parts.append(f"{field}: {message}" if field not in message else message)
    return f"invalid options for the {name} tier: " + "; ".join(parts)
