"""`GET /metrics`: Prometheus text format of the same snapshot as `/admin/metrics` (app.prometheus).

Admin access like the other admin routes once tenants are configured (a scraper sends
`Authorization: Bearer <admin key>`, Prometheus' `authorization` setting): per-tenant figures
are not public.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST

from app.auth import AdminAccess
from app.prometheus import render
from app.routes_admin import metrics_snapshot

router = APIRouter(tags=["admin"])


@router.get("/metrics", dependencies=[AdminAccess], response_class=Response)
async def prometheus_metrics(request: Request) -> Response:
    """Every figure of `/admin/metrics` as `kvgate_*` metrics (docs/metrics.md lists them)."""
    return Response(render(await metrics_snapshot(request)), media_type=CONTENT_TYPE_LATEST)
