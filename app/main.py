"""The app factory and its lifespan: load the engine off the event loop, drain on shutdown.

`/health` answers as soon as the process serves HTTP; `/ready` (and every `/v1/*` call) turns to
200 once the model is loaded in the engine process, and to 503 while draining or while a crashed
engine process restarts (see `engine.async_engine`).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from app import routes_admin, routes_openai
from app.errors import BodySizeLimitMiddleware, install_exception_handlers
from app.logging import AccessLogMiddleware, RequestCounters, configure_logging
from app.settings import Settings
from engine.async_engine import AsyncEngine

logger = logging.getLogger(__name__)


def create_app(settings: Settings, engine: AsyncEngine | None = None) -> FastAPI:
    """Build the app; with `engine` given it serves that engine instead of loading one."""
    app = FastAPI(title="KVGate", version="0.1.0", lifespan=_lifespan)
    state = app.state
    state.settings = settings
    state.registry = settings.tenant_registry()
    state.engine = None
    state.given_engine = engine
    state.load_error = None
    state.draining = False
    state.drain_task = None
    state.loop = None
    state.on_fatal = None  # set by the CLI: called with the exception if the model fails to load
    state.counters = RequestCounters()
    state.started_at = int(time.time())
    state.fingerprint = "fp_kvgate"
    install_exception_handlers(app)
    app.include_router(routes_openai.router)
    app.include_router(routes_admin.router)
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
        _serve_engine(app, engine)
    except Exception as exc:
        app.state.load_error = exc
        logger.exception("model failed to load model=%s", config.model)
        if app.state.on_fatal is not None:
            app.state.on_fatal(exc)


def begin_drain(app: FastAPI) -> None:
    """Stop taking requests and start the engine's shutdown (call on the event loop).

    The engine lets in-flight requests finish for `server.shutdown_timeout_s`, then aborts the
    rest, whose streams end with an error event and `[DONE]`; uvicorn meanwhile waits for the
    connections to close before running the lifespan shutdown.
    """
    state = app.state
    if state.draining:
        return
    state.draining = True
    if state.engine is not None:
        state.drain_task = asyncio.ensure_future(
            state.engine.shutdown(timeout_s=state.settings.server.shutdown_timeout_s))


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
            await state.drain_task
        if state.engine is not None:
            logger.info("shutting down engine timeout_s=%s", state.settings.server.shutdown_timeout_s)
            await state.engine.shutdown(timeout_s=state.settings.server.shutdown_timeout_s)
        logger.info("shutdown complete")
