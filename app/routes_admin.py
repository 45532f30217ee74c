"""Operational endpoints: `/health`, `/ready`, and the admin API (admin key once configured):
`/admin/metrics` (JSON; `/metrics` renders the same snapshot for Prometheus), `/admin/archetype`,
and attaching or detaching cache tiers at run time (`/admin/tiers`). Traces (`/admin/trace`)
have a router of their own.
"""

from __future__ import annotations

import hashlib
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from app.auth import AdminAccess, Engine, drain_retry_after_s, draining_headers, reload_tenants
from app.errors import NotFoundError
from app.prompts import builder_of
from app.public_prefixes import PrefixSpec
from app.settings import ConfigError
from engine.errors import InvalidRequestError

router = APIRouter(tags=["admin"])


@router.get("/health")
async def health() -> dict[str, str]:
    """200 whenever the process serves HTTP."""
    return {"status": "ok"}


@router.get("/ready")
async def ready(request: Request) -> JSONResponse:
    """200 once the model is loaded and the engine runs; 503 while loading, failed or draining."""
    state = request.app.state
    engine = state.engine
    if state.draining:  # the listener stays open while in-flight requests finish: say when to retry
        return JSONResponse({"status": "draining"}, status_code=503,
                            headers=draining_headers(drain_retry_after_s(state)))
    if engine is None:
        status = "failed" if state.load_error is not None else "loading"
    elif not engine.ready:
        status = engine.status if engine.status in ("restarting", "failed") else "not_ready"
    else:
        return JSONResponse({"status": "ready", "model": engine.model_name})
    return JSONResponse({"status": status}, status_code=503)


@router.get("/admin/replica", dependencies=[AdminAccess])
async def replica(request: Request, engine: Engine) -> dict[str, Any]:
    """What a router (`kvgate route`) needs to know of this replica: the model and its
    fingerprint (a prompt's block hashes depend on it), the block size, where KV events are
    published (null: off), its role (both, prefill or decode: docs/disaggregated.md; a prefill
    replica's waits for the shared store under ``shipped``), and an id that changes with every
    start of this server. ``shared_store``: where every computed block is written through to a
    store other replicas read, an id of that store (a digest of its address), else null."""
    stats = await engine.stats()
    events = stats.get("events")
    state = request.app.state
    ship = state.ship_counters
    return {"model": engine.model_name, "fingerprint": engine.fingerprint.hex(),
            "block_size": state.settings.cache.block_size, "max_model_len": engine.max_model_len,
            "instance": state.instance, "role": state.settings.server.role,
            "shipped": {"prompts": ship.waited, "wait_s": ship.wait_s, "late": ship.late},
            "shared_store": _shared_store(stats.get("tiers") or {}),
            "events": None if events is None else {k: events[k] for k in ("endpoint", "replay_endpoint", "topic")}}


def _shared_store(tiers: dict[str, Any]) -> str | None:
    """An id of the shared store this replica writes every block through to, or None."""
    for detail in tiers.values():
        if isinstance(detail, dict) and detail.get("url") and detail.get("write") == "through":
            return hashlib.blake2b(str(detail["url"]).encode(), digest_size=8).hexdigest()
    return None


class TierChange(BaseModel):
    """Body of `POST /admin/tiers`: attach or detach one cache tier of the running engine.

    ``tier`` names a kind of tier (`GET /admin/tiers` lists the attached ones; the built-in kinds
    are host, disk and remote). The other fields are that kind's options, checked by the kind
    itself: host takes ``capacity_mb``; disk ``path`` and ``capacity_mb``; remote ``url``,
    ``cluster``, ``ttl_s`` and ``write`` (through | back)."""

    model_config = ConfigDict(extra="allow")

    action: Literal["attach", "detach"]
    tier: str = Field(min_length=1, max_length=64)
    capacity_mb: int | None = None
    path: str | None = None
    url: str | None = None
    cluster: bool | None = None
    ttl_s: int | None = None
    write: str | None = None


@router.get("/admin/tiers", dependencies=[AdminAccess])
async def get_tiers(engine: Engine) -> dict[str, Any]:
    """The cache tiers below the device and their counters (as in `/admin/metrics` → `tiers`)."""
    return {"tiers": (await engine.stats()).get("tiers", {})}


@router.post("/admin/tiers", dependencies=[AdminAccess])
async def change_tier(body: TierChange, engine: Engine) -> dict[str, Any]:
    """Attach or detach a tier while serving; the other tiers keep what they hold.

    Options not given come from the server's configuration (`[cache.*]`). A disk `path` must be
    absolute, outside system folders and inside `[cache.disk] allowed_root` when that is set; a
    remote store must answer, or it is not attached. The reply says what changed
    (`{"ok", "action", "tier", ...}`); `GET /admin/tiers` has the counters.
    """
    options = body.model_dump(exclude={"action", "tier"}, exclude_none=True)
    return await engine.configure_tier(body.action, body.tier, options)


class PublicPrefixBody(BaseModel):
    """Body of `POST /admin/public-prefixes`: a name and exactly one of text, system, token_ids."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=64)
    text: str | None = Field(default=None, min_length=1)
    system: str | None = Field(default=None, min_length=1)
    token_ids: list[int] | None = Field(default=None, min_length=1)


@router.get("/admin/public-prefixes", dependencies=[AdminAccess])
async def list_public_prefixes(request: Request, engine: Engine) -> dict[str, Any]:
    """The declared public prefixes: name, how each was given, tokens, full blocks shared."""
    store = request.app.state.public_prefixes
    await store.ready(builder_of(request.app.state, engine))
    return {"public_prefixes": store.listing(engine.limits.block_size)}


@router.post("/admin/public-prefixes", dependencies=[AdminAccess])
async def add_public_prefix(body: PublicPrefixBody, request: Request, engine: Engine) -> dict[str, Any]:
    """Declare (or replace) a public prefix at run time: its full blocks hash in a namespace every
    tenant may hit; the blocks after it stay each tenant's own. Requests already running keep
    the hashes they started with."""
    given = [k for k in ("text", "system", "token_ids") if getattr(body, k)]
    if len(given) != 1:
        raise InvalidRequestError(f"give exactly one of text, system, token_ids (got {', '.join(given) or 'none'})",
                                  param="text")
    store = request.app.state.public_prefixes
    builder = builder_of(request.app.state, engine)
    await store.ready(builder)
    spec = PrefixSpec(body.name, body.text, body.system, tuple(body.token_ids) if body.token_ids else None)
    prefix = await store.add(spec, builder)
    return {"name": prefix.name, "tokens": len(prefix.token_ids),
            "shared_blocks": len(prefix.token_ids) // engine.limits.block_size}


@router.delete("/admin/public-prefixes/{name}", dependencies=[AdminAccess])
async def remove_public_prefix(name: str, request: Request) -> dict[str, Any]:
    """Stop sharing a prefix: later prompts hash it in their tenant's namespace again."""
    if not request.app.state.public_prefixes.remove(name):
        raise NotFoundError(f"no public prefix named {name!r}; GET /admin/public-prefixes lists them")
    return {"name": name, "removed": True}


@router.post("/admin/reload", dependencies=[AdminAccess])
async def reload(request: Request) -> dict[str, Any]:
    """Re-read the configuration's tenants and admin key (as SIGHUP does) without dropping a request:
    a removed key stops working at once, running requests finish as the tenant they started as."""
    try:
        return reload_tenants(request.app.state)
    except ConfigError as exc:
        raise InvalidRequestError(f"reload failed, the tenants in use are unchanged: {exc}", param=None) from None


@router.get("/admin/archetype", dependencies=[AdminAccess])
async def archetype(engine: Engine) -> dict[str, Any]:
    """Which KV-cache archetype the hierarchy is right now (Local-Paged, Shared-Store, Hybrid-Tier,
    ...), its four axes and each tier's part, computed from the live tiers (see docs/archetype.md).

    It changes when a tier is attached or detached, or when the remote store goes down.
    """
    return (await engine.stats()).get("archetype", {})


@router.get("/admin/metrics", dependencies=[AdminAccess])
async def metrics(request: Request) -> dict[str, Any]:
    """The engine's stats (blocks, queue, prefix cache, tiers, archetype, the seven gap metrics
    under `gaps`, TTFT parts under `timing`) plus the HTTP side's request figures under
    `requests` (docs/metrics.md says what each one means)."""
    return await metrics_snapshot(request)


async def metrics_snapshot(request: Request) -> dict[str, Any]:
    """One snapshot for `/admin/metrics` and `/metrics`: one round trip to the engine."""
    state = request.app.state
    engine = state.engine
    stats: dict[str, Any] = await engine.stats() if engine is not None else {}
    stats["model"] = engine.model_name if engine is not None else None
    stats["ready"] = bool(engine is not None and engine.ready and not state.draining)
    stats["requests"] = state.counters.snapshot()
    trace = getattr(state, "trace", None)
    if "gaps" in stats:
        stats["gaps"]["traces"] = {"recorded": len(trace) if trace is not None else 0,
                                   "capacity": getattr(trace, "capacity", None), "export": "/admin/trace"}
    return stats
