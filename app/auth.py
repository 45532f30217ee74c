"""Request dependencies: the caller's tenant, the admin check, docs access, and the serving engine.

`Authorization: Bearer <key>` resolves to a `Tenant` through the registry (hashed keys, constant
time); with no tenants configured every caller is the anonymous tenant and keys are ignored.
`reload_tenants` swaps in a registry rebuilt from the configuration file (SIGHUP or
`POST /admin/reload`): one assignment, so a request authenticates against the old registry or
the new one, never a mix; requests already running keep the tenant they started as.
"""

from __future__ import annotations

import logging
import math
from typing import Annotated, Any

from fastapi import Depends, Request

from app.errors import APIError, AuthenticationError
from app.settings import ConfigError, Settings
from engine.async_engine import AsyncEngine
from engine.errors import EngineDeadError, EngineNotReadyError
from tenants.registry import Tenant, TenantRegistry

logger = logging.getLogger(__name__)


def reload_tenants(state: Any) -> dict[str, Any]:
    """Re-read `[[tenants]]` and `[admin]` from the configuration and swap the registry in.

    Raises ConfigError (the old registry stays) when the file no longer parses, or when the
    server was not started from a configuration it can re-read. Other sections are not applied
    (they need a restart), and the server secret is re-read with them: changing it re-salts
    every namespace.
    """
    load = getattr(state, "reload_settings", None)
    if load is None:
        raise ConfigError("this server was not started by `kvgate serve`: there is no configuration to re-read")
    fresh: Settings = load()
    registry = fresh.tenant_registry()
    state.settings = state.settings.model_copy(update={"tenants": fresh.tenants, "admin": fresh.admin})
    state.registry = registry
    names = sorted(t.name for t in registry.tenants)
    logger.info("tenants reloaded: %d tenant(s) (%s), admin key %s", len(names), ", ".join(names) or "none",
                "set" if fresh.admin.api_key else "unset")
    return {"tenants": names, "admin_key": fresh.admin.api_key is not None}


def bearer_token(request: Request) -> str | None:
    """The key of an `Authorization: Bearer <key>` header, or None."""
    header = request.headers.get("authorization")
    if not header:
        return None
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


def get_registry(request: Request) -> TenantRegistry:
    return request.app.state.registry


def get_settings(request: Request) -> Settings:
    return request.app.state.settings


def get_tenant(request: Request, registry: Annotated[TenantRegistry, Depends(get_registry)]) -> Tenant:
    """The tenant the bearer key belongs to; 401 when a key is needed and missing or unknown."""
    token = bearer_token(request)
    tenant = registry.authenticate(token)
    if tenant is None:
        if token is None:
            raise AuthenticationError("You didn't provide an API key. Send it as "
                                      "'Authorization: Bearer <key>'.")
        raise AuthenticationError("Incorrect API key provided.")
    request.state.tenant = tenant.name
    return tenant


def require_admin(request: Request, registry: Annotated[TenantRegistry, Depends(get_registry)]) -> None:
    """Allow the call only with the admin key (open when no admin key and no tenants exist)."""
    request.state.tenant = "admin"
    if not registry.is_admin(bearer_token(request)):
        raise AuthenticationError("This endpoint needs the admin API key.")


def require_docs_access(request: Request, registry: Annotated[TenantRegistry, Depends(get_registry)]) -> None:
    """`[server] docs = "auth"`: any tenant's key or the admin key opens /docs and /openapi.json.

    With no tenants and no admin key there is no key to ask for, so the docs are open, as
    `/admin/*` is.
    """
    token = bearer_token(request)
    if registry.is_admin(token) or (not registry.open and registry.authenticate(token) is not None):
        return
    raise AuthenticationError("The API docs need a tenant or admin API key: send it as 'Authorization: "
                              "Bearer <key>' (e.g. curl /openapi.json), or set [server] docs = \"public\".")


class ServerDrainingError(APIError):
    """503 while the server drains: new work belongs to another replica or to the restarted server.

    `Retry-After` lets clients and load balancers back off instead of failing the request, and
    `Connection: close` makes them open a new connection (possibly to another replica) for it.
    """

    status_code = 503
    error_type = "service_unavailable"

    def __init__(self, retry_after_s: float) -> None:
        super().__init__("The server is shutting down; retry shortly (another replica, or this one once "
                         "restarted).", headers=draining_headers(retry_after_s))


def draining_headers(retry_after_s: float) -> dict[str, str]:
    return {"Retry-After": str(max(1, math.ceil(retry_after_s))), "Connection": "close"}


def drain_retry_after_s(state: Any) -> float:
    """`Retry-After` while draining: the drain's longest length, after which this server is gone
    (and restarted by its supervisor, or replaced by another replica behind the balancer)."""
    return float(state.settings.server.shutdown_timeout_s)


def get_engine(request: Request) -> AsyncEngine:
    """The running engine; 503 while it loads, after it failed, or while the server drains."""
    state = request.app.state
    if state.draining:
        raise ServerDrainingError(drain_retry_after_s(state))
    engine = state.engine
    if engine is None:
        if state.load_error is not None:
            raise EngineNotReadyError("The model failed to load.")
        raise EngineNotReadyError("The model is still loading; retry shortly.")
    if not engine.ready:
        if engine.status == "restarting":
            raise EngineDeadError("The engine process stopped and is restarting; retry shortly.")
        raise EngineNotReadyError("The engine is not ready.")
    return engine


CurrentTenant = Annotated[Tenant, Depends(get_tenant)]
AdminAccess = Depends(require_admin)
DocsAccess = Depends(require_docs_access)
Engine = Annotated[AsyncEngine, Depends(get_engine)]
SettingsDep = Annotated[Settings, Depends(get_settings)]
