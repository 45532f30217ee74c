"""The app factory and its lifespan: load the engine off the event loop, drain on shutdown.

`/health` answers as soon as the process serves HTTP; `/ready` (and every `/v1/*` call) turns to
200 once the model is loaded in the engine process, and to 503 while draining or while a crashed
engine process restarts (see `engine.async_engine`).

Draining (`begin_drain`, on SIGTERM/SIGINT) keeps the listener open: new connections still get
an answer, a 503 with `Retry-After`, instead of "connection refused", while requests in flight
finish. Only when the engine's drain is done does `on_drained` tell the HTTP server to stop.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI

from app import (
    routes_admin,
    routes_audit,
    routes_cache,
    routes_dashboard,
    routes_metrics,
    routes_openai,
    routes_trace,
)
from app.api_docs import install_docs
from app.disagg import ShipCounters
from app.errors import BodySizeLimitMiddleware, install_exception_handlers
from app.logging import AccessLogMiddleware, RequestCounters, configure_logging
from app.public_prefixes import PrefixSpec, PublicPrefixStore
from app.settings import Settings
from engine.async_engine import AsyncEngine
from tenants.limits import RateLimiter

logger = logging.getLogger(__name__)


def create_app(settings: Settings, engine: AsyncEngine | None = None,
               reload: Callable[[], Settings] | None = None) -> FastAPI:
    """Build the app; with `engine` given it serves that engine instead of loading one.

    `reload` re-reads the configuration (the CLI passes it): SIGHUP and `POST /admin/reload`
    then swap in its tenants (app.auth.reload_tenants).
    """
    # The built-in docs routes are off: app.api_docs serves them without a CDN, per [server] docs.
    app = FastAPI(title="KVGate", version="0.1.0", lifespan=_lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    state = app.state
    state.settings = settings
    state.reload_settings = reload
    state.registry = settings.tenant_registry()
    state.public_prefixes = PublicPrefixStore([
        PrefixSpec(p.name, p.text, p.system, tuple(p.token_ids) if p.token_ids else None)
        for p in settings.public_prefixes])
    state.engine = None
    state.given_engine = engine
    state.load_error = None
    state.draining = False
    state.drain_task = None
    state.loop = None
    state.on_fatal = None  # set by the CLI: called with the exception if the model fails to load
    state.on_drained = None  # set by the CLI: called once the drain is over, to stop the HTTP server
    state.counters = RequestCounters()
    state.limiter = RateLimiter()  # per-tenant rate and concurrency limits (tenants.limits)
    state.started_at = int(time.time())
    state.instance = uuid.uuid4().hex  # this start of the server (`GET /admin/replica`)
    state.ship_counters = ShipCounters()  # [server] role = "prefill": waits for the shared store
    state.fingerprint = "fp_kvgate"
    install_exception_handlers(app)
    app.include_router(routes_openai.router)
    app.include_router(routes_cache.router)
    app.include_router(routes_admin.router)
    app.include_router(routes_audit.router)
    app.include_router(routes_metrics.router)
    app.include_router(routes_trace.router)
    app.include_router(routes_dashboard.router)
    install_docs(app, settings.server.docs_mode(has_tenants=bool(settings.tenants)))
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=settings.server.max_body_bytes)
    app.add_middleware(AccessLogMiddleware, counters=state.counters)
    return app


def _serve_engine(app: FastAPI, engine: AsyncEngine) -> None:
    if not engine.ready:
        engine.start()
    identity = f"{engine.model_name}:{engine.fingerprint!r}"
    app.state.fingerprint = "fp_" + hashlib.sha256(identity.encode()).hexdigest()[:10]
    app.state.engine = engine
    logger.info("engine ready model=%s max_model_len=%d", engine.model_name, engine.max_model_len)


async def _load_engine(app: FastAPI) -> None:
    settings: Settings = app.state.settings
    config = settings.engine_config()
    logger.info("loading model=%s dtype=%s", config.model, config.dtype)
    try:
        level = logging.getLevelName(logging.getLogger().getEffectiveLevel()).lower()
        engine = await asyncio.to_thread(AsyncEngine.from_config, config, process=True,
                                         initializer=configure_logging, initargs=(level,))
        if app.state.draining:
            await engine.shutdown(timeout_s=0)
            return
        engine.on_fatal = app.state.on_fatal
        engine.on_stop = lambda name: _stop_requested(app, name)
        _serve_engine(app, engine)
    except Exception as exc:
        # One line: the message says what is wrong; the traceback only helps a developer.
        app.state.load_error = exc
        logger.error("model failed to load model=%s: %s%s", config.model, exc,
                     "" if logger.isEnabledFor(logging.DEBUG) else " (--log-level debug shows the traceback)",
                     exc_info=logger.isEnabledFor(logging.DEBUG))
        if app.state.on_fatal is not None:
            app.state.on_fatal(exc)


def begin_drain(app: FastAPI) -> None:
    """Stop taking requests and start the engine's drain (call on the event loop; idempotent).

    The engine lets in-flight requests finish for `server.shutdown_timeout_s`, then aborts the
    rest, whose streams end with an error event and `[DONE]`. Meanwhile the listener stays open
    and new requests get 503 with `Retry-After`. When the engine's drain is done (or at once,
    when no engine is loaded yet) `state.on_drained` is called, which stops the HTTP server.
    """
    state = app.state
    if state.draining:
        return
    state.draining = True
    engine = state.engine
    if engine is None:
        _drained(app)
        return
    timeout_s = state.settings.server.shutdown_timeout_s
    logger.info("draining: no new requests, in-flight ones get up to %ss to finish", timeout_s)
    state.drain_task = asyncio.ensure_future(engine.shutdown(timeout_s=timeout_s))
    state.drain_task.add_done_callback(lambda _task: _drained(app))


def _stop_requested(app: FastAPI, signal_name: str) -> None:
    """The engine process was sent SIGTERM/SIGINT (alone, or with this process as a group):
    drain exactly as for a signal to this process."""
    if not app.state.draining:
        logger.info("the engine process got %s: draining as for a stop signal", signal_name)
    begin_drain(app)


def _drained(app: FastAPI) -> None:
    task = app.state.drain_task
    if task is not None and not task.cancelled() and task.exception() is not None:
        logger.error("engine drain failed: %s", task.exception())
    logger.info("drain complete")
    if app.state.on_drained is not None:
        app.state.on_drained()


@asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    state = app.state
    state.loop = asyncio.get_running_loop()
    loader: asyncio.Task[None] | None = None
    if state.given_engine is not None:
        _serve_engine(app, state.given_engine)
    else:
        loader = asyncio.create_task(_load_engine(app))
    try:
        yield
    finally:
        state.draining = True
        if loader is not None and not loader.done():
            loader.cancel()
        if state.drain_task is not None:
            await asyncio.gather(state.drain_task, return_exceptions=True)
        elif state.engine is not None:  # stopped without a drain (e.g. the model's loading failed)
            logger.info("shutting down engine timeout_s=%s", state.settings.server.shutdown_timeout_s)
            await state.engine.shutdown(timeout_s=state.settings.server.shutdown_timeout_s)
        pool = getattr(state, "prompt_pool", None)
        if pool is not None:
            pool.close()
        logger.info("shutdown complete")
