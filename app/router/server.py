"""The router's HTTP side: the OpenAI API of a replica, each request sent on to the replica the
score picks (app/router/index.py, app/router/relay.py), its answer streamed back as it comes.

    POST /v1/completions, /v1/chat/completions  auth as a replica does (same tenants and secret)
        → tokens (the model's tokenizer, the chat template) → the tenant's salted block hashes
        → the cheapest healthy replica (a prefill leg first in a Disaggregated-Pipeline)
    POST /v1/cache/{lookup,prefetch,pin,unpin}   where a request of that prefix would go
    DELETE /v1/cache, unpin {"all": true}        to every replica, their answers summed
    GET  /v1/models[/id]                         relayed to a healthy replica
    GET  /health, /ready                         the router itself; ready while a replica is
    GET  /admin/router                           replicas, their health, load and index (admin key)

The replicas authenticate, limit and validate every request again; the router only reads what
it needs to score one, and a body it cannot read is routed on load alone (the replica answers
the error).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import APIRouter, FastAPI, Request, Response
from fastapi.responses import JSONResponse

from app.auth import AdminAccess, CurrentTenant, bearer_token
from app.errors import install_exception_handlers
from app.router.index import choose
from app.router.relay import DEFAULT_MAX_TOKENS, NoReplicaError, Router
from app.router.replicas import Replicas
from app.settings import Settings
from tenants.registry import Tenant

routes = APIRouter()


def _router(request: Request) -> Router:
    return request.app.state.router


@routes.get("/health")
async def health() -> dict[str, str]:
    return {"status": "ok"}


@routes.get("/ready")
async def ready(request: Request) -> JSONResponse:
    """200 while at least one replica is in rotation."""
    healthy = sum(r.healthy for r in _router(request).replicas)
    return JSONResponse({"status": "ready" if healthy else "no_replica", "replicas_ready": healthy},
                        status_code=200 if healthy else 503)


@routes.get("/admin/router", dependencies=[AdminAccess])
async def admin_router(request: Request) -> dict[str, Any]:
    """Replicas, health, load, what their KV events say they hold, and the decisions so far."""
    return _router(request).snapshot()


@routes.get("/v1/models")
@routes.get("/v1/models/{model_id:path}")
async def models(request: Request, tenant: CurrentTenant) -> Response:
    router = _router(request)
    order = sorted(router.estimates(None, tenant, None, 0), key=lambda e: (e.in_flight, e.replica))
    return await router.relay(request, b"", order)


@routes.delete("/v1/cache")
async def cache_delete(request: Request) -> Response:
    """A tenant's blocks go from every replica (the replicas authenticate it)."""
    return await _router(request).fan_out(request, await request.body())


@routes.post("/v1/cache/{op}")
async def cache_op(op: str, request: Request) -> Response:
    """lookup, prefetch, pin and unpin of one prefix go where a request of that prefix would go,
    so a pinned or prefetched prefix is where it will be used; an unpin of everything goes to all."""
    router = _router(request)
    raw = await request.body()
    try:
        body = json.loads(raw)
    except ValueError:
        body = None
    if isinstance(body, dict) and body.get("all") is True:
        return await router.fan_out(request, raw)
    token = bearer_token(request)
    tenant = router.registry.authenticate(token)
    if tenant is None and router.registry.is_admin(token) and isinstance(body, dict):
        tenant = router.registry.get(str(body.get("tenant")))  # the admin key acting for a tenant
    if tenant is None or not isinstance(body, dict):  # the replica says what is wrong
        order = sorted(router.estimates(None, router.registry.anonymous, None, 0),
                       key=lambda e: (e.in_flight, e.replica))
        return await router.relay(request, raw, order)
    return await _route(router, request, raw, body, tenant)


@routes.post("/v1/completions")
@routes.post("/v1/chat/completions")
async def generate(request: Request, tenant: CurrentTenant) -> Response:
    raw = await request.body()
    try:
        body = json.loads(raw)
        if not isinstance(body, dict):
            raise ValueError("not an object")
    except ValueError:
        body = {}
    return await _route(_router(request), request, raw, body, tenant, generation=True)


async def _route(router: Router, request: Request, raw: bytes, body: dict[str, Any], tenant: Tenant,
                 generation: bool = False) -> Response:
    """Score the request's prompt, run a disaggregated request's prefill leg, relay the rest."""
    ids = await router.prompt_ids(request.url.path, body) if body else None
    cache_salt = body.get("cache_salt") if isinstance(body.get("cache_salt"), str) else None
    max_tokens = body.get("max_completion_tokens") or body.get("max_tokens") or DEFAULT_MAX_TOKENS
    max_tokens = max_tokens if isinstance(max_tokens, int) and max_tokens > 0 else DEFAULT_MAX_TOKENS
    if not generation:
        max_tokens = 0
    prefill_only = router.estimates(ids, tenant, cache_salt, 0, roles=("prefill",)) if generation else []
    decode_only = router.estimates(ids, tenant, cache_salt, max_tokens, roles=("decode",)) if generation else []
    if prefill_only and decode_only and body:  # a Disaggregated-Pipeline: prompt on one, decode on another
        router.decisions["disaggregated"] += 1
        first = choose(prefill_only, router.turn)
        order = [first, *sorted((e for e in prefill_only if e is not first), key=lambda e: e.cost)]
        refused = await router.prefill(request, body, order, (len(ids) if ids else 0) - int(first.cached_tokens))
        if refused is not None:
            return refused
        estimates = decode_only
    else:
        estimates = router.estimates(ids, tenant, cache_salt, max_tokens, roles=("both",)) or \
            router.estimates(ids, tenant, cache_salt, max_tokens)
    if not estimates:
        raise NoReplicaError("No replica is in rotation; retry shortly.", headers={"Retry-After": "1"})
    best = choose(estimates, router.turn) if router.policy == "prefix" else \
        estimates[router.turn % len(estimates)]
    router.turn += 1
    if ids is None:
        router.decisions["unscored"] += 1
    elif best.cached_tokens > 0:
        router.decisions["prefix"] += 1
    else:
        router.decisions["load"] += 1
    router.predicted_cached_tokens += int(best.cached_tokens)
    order = [best, *sorted((e for e in estimates if e is not best), key=lambda e: e.cost)]
    return await router.relay(request, raw, order, (len(ids) if ids else 0) - int(best.cached_tokens), max_tokens)


def create_router_app(settings: Settings, replicas: Replicas, tokenizer: Any, load_weight: float = 1.0,
                      policy: str = "prefix") -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await replicas.start()
        try:
            yield
        finally:
            await router.close()
            await replicas.close()

    app = FastAPI(title="KVGate router", version="0.1.0", lifespan=lifespan, docs_url=None, redoc_url=None)
    router = Router(settings, replicas, tokenizer, load_weight, policy)
    app.state.router = router
    app.state.registry = router.registry
    app.state.settings = settings
    install_exception_handlers(app)
    app.include_router(routes)
    return app
