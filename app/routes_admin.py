"""Operational endpoints: `/health`, `/ready`, and `GET /admin/metrics` (admin key once configured).

The full admin API (archetype, traces, dashboard, Prometheus) is a later issue; this file serves
what operators and tests need now: liveness, readiness, and the engine's block accounting.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from app.auth import AdminAccess

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
    if state.draining:
        status = "draining"
    elif engine is None:
        status = "failed" if state.load_error is not None else "loading"
    elif not engine.ready:
        status = engine.status if engine.status in ("restarting", "failed") else "not_ready"
    else:
        return JSONResponse({"status": "ready", "model": engine.model_name})
    return JSONResponse({"status": status}, status_code=503)


@router.get("/admin/metrics", dependencies=[AdminAccess])
async def metrics(request: Request) -> dict[str, Any]:
    """The engine's stats (blocks, queue, prefix cache) at the top level, plus request counters."""
    state = request.app.state
    stats: dict[str, Any] = await state.engine.stats() if state.engine is not None else {}
    stats["model"] = state.engine.model_name if state.engine is not None else None
    stats["ready"] = bool(state.engine is not None and state.engine.ready and not state.draining)
    stats["requests"] = state.counters.snapshot()
    return stats
