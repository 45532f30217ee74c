"""Operational endpoints: `/health`, `/ready`, and the admin API (admin key once configured):
`/admin/metrics` (JSON; `/metrics` renders the same snapshot for Prometheus), `/admin/archetype`,
and attaching or detaching cache tiers at run time (`/admin/tiers`). The dashboard (`/admin`)
and traces (`/admin/trace`) have routers of their own.
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from app.auth import AdminAccess, Engine, drain_retry_after_s, draining_headers

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


class TierChange(BaseModel):
    """Body of `POST /admin/tiers`: attach or detach one cache tier of the running engine."""

    model_config = ConfigDict(extra="forbid")

    action: Literal["attach", "detach"]
    tier: Literal["host", "disk", "remote"]
    capacity_mb: int | None = Field(default=None, gt=0)
    path: str | None = None
    url: str | None = None
    cluster: bool | None = None
    ttl_s: int | None = Field(default=None, gt=0)
    write: Literal["through", "back"] | None = None


@router.get("/admin/tiers", dependencies=[AdminAccess])
async def get_tiers(engine: Engine) -> dict[str, Any]:
    """The cache tiers below the device and their counters (as in `/admin/metrics` → `tiers`)."""
    return {"tiers": (await engine.stats()).get("tiers", {})}


@router.post("/admin/tiers", dependencies=[AdminAccess])
async def change_tier(body: TierChange, engine: Engine) -> dict[str, Any]:
    """Attach or detach a tier while serving; the other tiers keep what they hold.

    Options not given come from the server's configuration (`[cache.*]`).
    """
    options = body.model_dump(exclude={"action", "tier"}, exclude_none=True)
    return {"tiers": await engine.configure_tier(body.action, body.tier, options)}


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
