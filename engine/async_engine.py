"""AsyncEngine: the serving side of the engine — request streams, detokenization, stop strings.

    event loop (API process)                     engine backend (process or thread)
    add_request ─ validate ─▶ send("add") ──────▶ EngineLoop: commands → core.step() → outputs
    RequestStream ◀─ detokenize, stop strings ◀── on_event("out") hopped onto the event loop

The HTTP layer only sees this class: ``add_request`` raises typed errors before anything is
sent, the returned stream yields ``RequestOutput`` deltas (built in `engine.request_streams`),
``abort`` frees blocks at once. The backend (see `engine.backends`) loads the model and steps it
on one thread of its own; serving uses an engine process, tests and benchmarks may use a thread.
If the engine process dies, every request in flight fails with a 503, the engine is restarted
(``max_restarts`` within ``RESTART_WINDOW_S``), and past that the ``on_fatal`` callback is told.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from engine.backends import ProcessBackend, ThreadBackend
from engine.cache_control import CacheCommand
from engine.config import EngineConfig
from engine.errors import EngineDeadError, EngineNotReadyError, EngineOverloadedError, InvalidRequestError
from engine.limits import RequestLimits
from engine.loop import EngineInfo, FailInfo
from engine.outputs import GenerateRequest, RequestOutput
from engine.request_streams import RequestStream, RequestStreams
from engine.tier_preflight import preflight_attach

logger = logging.getLogger(__name__)

RESTART_WINDOW_S = 300.0
STATS_TIMEOUT_S = 10.0
CACHE_TIMEOUT_S = 30.0  # a cache control command's tier I/O (disk reads and Redis each have their own deadlines)


class AsyncEngine:
    """Serves many concurrent requests from one engine backend."""

    def __init__(self, backend: ThreadBackend | ProcessBackend, max_queue: int = 256, max_restarts: int = 3) -> None:
        self.backend = backend
        self.max_queue = max_queue
        self.max_restarts = max_restarts
        self.on_fatal: Callable[[BaseException], None] | None = None
        # called (on the event loop) with the signal's name when the engine process was asked to stop
        self.on_stop: Callable[[str], None] | None = None
        self._early_stop: tuple[Any, ...] | None = None
        self.info: EngineInfo | None = None
        self.tokenizer: Any = None
        self.restarts: list[float] = []
        self._streams = RequestStreams()
        self._waiters: dict[int, asyncio.Future[Any]] = {}  # replies to "stats", "tiers" and "cache"
        self._reply_tokens = itertools.count()
        self._last_stats: dict[str, Any] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._running = False
        self._accepting = False
        self._alive = False
        self._restart_task: asyncio.Task[None] | None = None

    @classmethod
    def from_config(cls, config: EngineConfig, process: bool = False,
                    initializer: Callable[..., None] | None = None, initargs: tuple[Any, ...] = ()) -> AsyncEngine:
        """Load the model and build the engine (blocking: seconds to minutes).

        ``process=True`` runs the engine in its own process (what `kvgate serve` does), with
        ``initializer(*initargs)`` called there first (e.g. to configure logging).
        """
        backend = ProcessBackend(config, initializer, initargs) if process else ThreadBackend(config)
        engine = cls(backend, max_queue=config.max_queue)
        engine.load()
        return engine

    def load(self) -> None:
        """Start the backend and wait until its model is loaded (blocking)."""
        self.info = self.backend.start(self._on_event)
        self.tokenizer = self.backend.tokenizer
        self._alive = True

    # ---- what the HTTP layer reads ------------------------------------------------------------
    @property
    def model_name(self) -> str:
        return self._info.model_name

    @property
    def max_model_len(self) -> int:
        return self._info.limits.max_model_len

    @property
    def limits(self) -> RequestLimits:
        """The loaded engine's request limits (vocabulary, context, block size, pool)."""
        return self._info.limits

    @property
    def fingerprint(self) -> bytes:
        return self._info.fingerprint

    @property
    def _info(self) -> EngineInfo:
        assert self.info is not None, "AsyncEngine.load() has not run"
        return self.info

    @property
    def ready(self) -> bool:
        return self._running and self._accepting and self._alive

    @property
    def status(self) -> str:
        """ready | restarting | failed | stopped, for /ready."""
        if self._alive:
            return "ready" if self._running and self._accepting else "stopped"
        return "restarting" if self._restart_task is not None and not self._restart_task.done() else "failed"

    def start(self) -> None:
        """Begin serving; call from the event loop that will consume the streams."""
        self._loop = asyncio.get_running_loop()
        self._running = True
        self._accepting = True
        if self._early_stop is not None:
            self._loop.call_soon(self._handle_event, self._early_stop)
            self._early_stop = None

    # ---- requests (event loop thread) -------------------------------------------------------
    @property
    def max_sequences(self) -> int:
        """The most sequences one call may start: all running slots plus the whole queue."""
        return self._info.max_num_seqs + self.max_queue

    def add_request(self, request: GenerateRequest) -> RequestStream:
        """Validate and enqueue a request; raises a typed error before anything is sent."""
        return self.add_requests([request])[0]

    def add_requests(self, requests: list[GenerateRequest]) -> list[RequestStream]:
        """Validate and enqueue the requests of one call together: all of them, or none.

        The queue limit counts sequences (each request brings `n`), and a call that could never
        be admitted (more sequences than `max_num_seqs + max_queue`, more KV blocks than the
        pool) is a 400 up front rather than a 429 the client would retry forever.
        """
        if not self.ready:
            if self._running and self._accepting and not self._alive:
                raise EngineDeadError("the engine process stopped and is restarting; retry shortly")
            raise EngineNotReadyError("the engine is not accepting requests (starting or shutting down)")
        info = self._info
        ids = [r.request_id for r in requests]
        for request in requests:
            if request.request_id in self._streams or ids.count(request.request_id) > 1:
                raise InvalidRequestError(f"request id {request.request_id!r} is already running",
                                          param="request_id")
            info.limits.validate(request)
        size = sum(r.params.n for r in requests)
        if size > self.max_sequences:
            raise InvalidRequestError(
                f"this request starts {size} sequences but the server holds at most {self.max_sequences} "
                f"({info.max_num_seqs} running + server.max_queue = {self.max_queue} waiting); "
                "send fewer prompts or a smaller n", param="n", code="too_many_sequences")
        info.limits.validate_job(requests)
        # Sequences beyond the running capacity (max_num_seqs) count as waiting. Deciding from the
        # loop thread's own bookkeeping keeps the limit exact: the engine's view lags a step.
        waiting = self.num_active_sequences - info.max_num_seqs
        if waiting + size > self.max_queue:
            raise EngineOverloadedError(
                f"{max(waiting, 0)} sequences are already waiting beyond the {info.max_num_seqs} running and "
                f"this request brings {size} (server.max_queue = {self.max_queue}); retry shortly")
        streams = []
        for request in requests:
            streams.append(self._streams.add(request, self.tokenizer))
            self.backend.send(("add", request))
        return streams

    @property
    def num_active_sequences(self) -> int:
        """Sequences of the requests in flight that have not finished (running or waiting)."""
        return self._streams.num_active_sequences

    async def generate(self, request: GenerateRequest) -> AsyncIterator[RequestOutput]:
        """Convenience wrapper: add the request and yield its outputs, aborting if cancelled."""
        stream = self.add_request(request)
        try:
            async for out in stream:
                yield out
        finally:
            self.abort(request.request_id)

    def abort(self, request_id: str) -> None:
        """Stop a request now and free its blocks; idempotent, safe after it finished."""
        if request_id in self._streams:
            self.backend.send(("abort", request_id))
            self._streams.abort(request_id)

    async def stats(self) -> dict[str, Any]:
        """Queue, pool and cache figures from the engine (see ``EngineCore.stats``), plus streams.

        While the engine is unavailable (restarting, stopped) the last snapshot is returned.
        """
        snapshot = dict(self._last_stats)
        if self._alive and self._loop is not None:
            try:
                snapshot = await self._call("stats")
                self._last_stats = dict(snapshot)
            except (asyncio.TimeoutError, EngineDeadError):
                pass
        snapshot["num_streams"] = len(self._streams)
        snapshot["engine"] = {"mode": self.backend.kind, "status": self.status, "restarts": len(self.restarts),
                              "pid": self.info.pid if self.info is not None else None}
        return snapshot

    async def configure_tier(self, action: str, tier: str, options: dict[str, Any]) -> dict[str, Any]:
        """Attach or detach a cache tier in the running engine; returns what changed.

        Raises ``InvalidRequestError`` with the engine's reason when it cannot be done. An attach
        runs the tier kind's preflight here first (see `engine.tier_preflight`); a tier that fails
        it is refused and nothing is attached.
        """
        if not self.ready:
            raise EngineNotReadyError("the engine is not ready; retry shortly")
        if action == "attach":
            await preflight_attach(self.backend.config, tier, options)
        reply = await self._call("tiers", action, tier, options)
        if not reply.get("ok"):
            raise InvalidRequestError(reply.get("error", "tier change failed"), param="tier")
        return reply["tiers"]

    async def cache_control(self, command: CacheCommand, timeout_s: float = CACHE_TIMEOUT_S) -> dict[str, Any]:
        """Run a cache control command in the engine (engine/cache_control.py) and return its
        answer: ``{"ok": True, ...}`` or ``{"ok": False, "status", "message", "code", "param"}``.
        Raises asyncio.TimeoutError when the engine and its tiers do not answer in ``timeout_s``."""
        if not self.ready:
            raise EngineNotReadyError("the engine is not ready; retry shortly")
        return dict(await self._call("cache", command, timeout_s=timeout_s))

    async def _call(self, kind: str, *args: Any, timeout_s: float = STATS_TIMEOUT_S) -> Any:
        """Send a command that the engine answers with ("reply", token, value); await the value."""
        assert self._loop is not None
        token = next(self._reply_tokens)
        future: asyncio.Future[Any] = self._loop.create_future()
        self._waiters[token] = future
        self.backend.send((kind, token, *args))
        try:
            return await asyncio.wait_for(future, timeout_s)
        finally:
            self._waiters.pop(token, None)

    async def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop accepting, let in-flight requests finish for up to ``timeout_s``, abort the rest."""
        self._accepting = False
        deadline = time.monotonic() + timeout_s
        while self._streams and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for request_id in list(self._streams):
            self.abort(request_id)
        if self._restart_task is not None and not self._restart_task.done():
            self._restart_task.cancel()
        if self._alive:
            await self.stats()  # the final snapshot, after the aborts above, stays readable
        if self._running or self._alive:
            self._running = False
            self._alive = False
            await asyncio.to_thread(self.backend.close, 30.0)

    # ---- events from the backend (any thread) -------------------------------------------------
    def _on_event(self, event: tuple[Any, ...]) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            if event[0] == "stop":  # a stop signal while the model loaded: acted on in start()
                self._early_stop = event
            return
        try:
            loop.call_soon_threadsafe(self._handle_event, event)
        except RuntimeError:  # loop closed between the check and the call
            pass

    def _handle_event(self, event: tuple[Any, ...]) -> None:
        kind = event[0]
        if kind == "out":
            self._streams.dispatch(event[1], self._stop_choice)
        elif kind == "fail":
            self._streams.fail(event[1], event[2].error() if isinstance(event[2], FailInfo) else event[2])
        elif kind == "reply":
            future = self._waiters.pop(event[1], None)
            if future is not None and not future.done():
                future.set_result(event[2])
        elif kind == "dead":
            self._on_dead(event[1])
        elif kind == "stop":  # the engine process got SIGTERM/SIGINT: the server should drain
            if self.on_stop is not None:
                self.on_stop(event[1])

    def _stop_choice(self, request_id: str, index: int) -> None:
        self.backend.send(("stop_choice", request_id, index))

    def _on_dead(self, reason: str) -> None:
        if not self._alive:
            return
        self._alive = False
        logger.error("engine process stopped unexpectedly (%s); failing %d requests in flight",
                     reason, len(self._streams))
        error = EngineDeadError(f"the engine process stopped unexpectedly ({reason}); retry shortly")
        self._streams.fail_all(error)
        for future in self._waiters.values():
            if not future.done():
                future.set_exception(error)
        self._waiters.clear()
        if self._running and self._accepting:
            self._restart_task = asyncio.ensure_future(self._restart(reason))

    async def _restart(self, reason: str) -> None:
        now = time.monotonic()
        self.restarts = [t for t in self.restarts if now - t < RESTART_WINDOW_S] + [now]
        if len(self.restarts) > self.max_restarts:
            self._fatal(EngineDeadError(
                f"the engine process stopped {len(self.restarts)} times in {RESTART_WINDOW_S:.0f} s "
                f"(last: {reason}); giving up"))
            return
        logger.warning("restarting the engine process (restart %d of at most %d per %.0f s)",
                       len(self.restarts), self.max_restarts, RESTART_WINDOW_S)
        try:
            await asyncio.to_thread(self.backend.close, 5.0)
            await asyncio.to_thread(self.load)
        except Exception as exc:
            logger.exception("the engine failed to restart")
            self._fatal(exc)
            return
        logger.info("engine restarted pid=%s", self._info.pid)

    def _fatal(self, exc: BaseException) -> None:
        logger.error("%s", exc)
        if self.on_fatal is not None:
            self.on_fatal(exc)
