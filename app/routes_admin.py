"""Operational endpoints: `/health`, `/ready`, and `GET /admin/metrics` (admin key once configured).

The full admin API (archetype, traces, dashboard, Prometheus) is planned (docs/CONTRACT.md,
"Planned"); this file serves what operators and tests need now: liveness, readiness, the
engine's block accounting, and attaching or detaching cache tiers at run time (`/admin/tiers`).
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
    """The engine's stats (blocks, queue, prefix cache) at the top level, plus request counters."""
    state = request.app.state
    stats: dict[str, Any] = await state.engine.stats() if state.engine is not None else {}
    stats["model"] = state.engine.model_name if state.engine is not None else None
    stats["ready"] = bool(state.engine is not None and state.engine.ready and not state.draining)
    stats["requests"] = state.counters.snapshot()
    return stats
