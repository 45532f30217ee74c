"""Structured access log and request counters, from one pure ASGI middleware.

One line per request once its last body byte is sent (so streams are logged when they end):
`request_id tenant method path status prompt_tokens completion_tokens cached_tokens ttft_ms
duration_ms`, as `key=value` pairs and as `extra` fields for JSON log handlers. Handlers add
their figures to `request.state` (`tenant`, `completion_id`, `usage`, `ttft_s`, `disconnected`,
`stream_error`). A stream's status line went out as 200 before it could fail, so the log shows
what really happened: 499 when the client left, the error's status (503 for a stream cut by
shutdown) when the stream ended with an error event.

`/health` and `/ready` are logged at DEBUG: load balancers and `kvgate`'s own tests poll them
every second, which would bury the requests that matter. The counters key requests by route
template (`/v1/models/{model_id:path}`), with every unrouted URL in one `unmatched` bucket, so
that scanning random URLs cannot grow `/admin/metrics` without bound.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from engine.telemetry import SECONDS, Histogram

access_logger = logging.getLogger("kvgate.access")
UVICORN_LOGGER, SERVER_LOGGER = "uvicorn.error", "kvgate.server"
_REQUEST_ID_RE = re.compile(r"^[A-Za-z0-9._:-]{1,64}$")
_LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
QUIET_PATHS = frozenset({"/health", "/ready"})
UNMATCHED = "unmatched"
MAX_TENANT_LABELS = 256  # tenants beyond this many share one "other" entry (bounded label cardinality)


def configure_logging(level: str = "info") -> None:
    """Plain `key=value` lines on stderr for the app, uvicorn and the engine.

    Also the engine process's initializer. When stderr is not a terminal (a log file, journald,
    a pipe) progress bars are turned off: their carriage-return redraws run together into one
    unreadable line there, and KVGate logs each step of a download or conversion as a line anyway.
    uvicorn's own lines are KVGate's server lines (`ServerLogFilter`).
    """
    logging.basicConfig(level=level.upper(), format=_LOG_FORMAT)
    server_logger = logging.getLogger(UVICORN_LOGGER)
    if not any(isinstance(f, ServerLogFilter) for f in server_logger.filters):
        server_logger.addFilter(ServerLogFilter())
    progress_bars_only_on_terminal()


class ServerLogFilter(logging.Filter):
    """uvicorn logs its start and stop steps at INFO from a logger named `uvicorn.error`
    ("Started server process", "Application startup complete." while the model is still
    loading): under KVGate's own name (`kvgate.server`) and at DEBUG, since `app.cli` and
    `app.main` already log when the server listens and when it is ready. Its warnings and
    errors (a malformed request, an exception in the app) keep their level."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.name = SERVER_LOGGER
        if record.levelno == logging.INFO:
            record.levelno, record.levelname = logging.DEBUG, "DEBUG"
            return logging.getLogger(SERVER_LOGGER).isEnabledFor(logging.DEBUG)
        return True


def progress_bars_only_on_terminal() -> None:
    """Turn progress bars off unless stderr is a terminal (where their redraws work)."""
    if not _is_terminal(sys.stderr):
        disable_progress_bars()


def disable_progress_bars() -> None:
    """Silence tqdm bars of huggingface_hub, transformers and tqdm itself, here and in children.

    The environment variables reach processes started later (the engine process) and libraries
    imported later; the calls cover libraries that are already imported. A value the user set
    is kept.
    """
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TQDM_DISABLE", "1")
    if "huggingface_hub" in sys.modules:
        from huggingface_hub.utils import disable_progress_bars as hub_disable

        hub_disable()
    if "transformers" in sys.modules:
        from transformers.utils.logging import disable_progress_bar

        disable_progress_bar()


def _is_terminal(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # replaced or closed stream
        return False


def route_label(scope: Scope) -> str:
    """The route template that served the request (`/v1/models/{model_id:path}`), or `unmatched`."""
    route = scope.get("route")
    path = getattr(route, "path", None)
    return path if isinstance(path, str) and path else UNMATCHED


@dataclass
class TenantCounters:
    """One tenant's request figures (tenant "-" = no key: tenants are not configured)."""

    requests: int = 0
    errors: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    ttft_s: Histogram = field(default_factory=lambda: Histogram(SECONDS))

    def snapshot(self) -> dict[str, Any]:
        return {"requests": self.requests, "errors": self.errors, "prompt_tokens": self.prompt_tokens,
                "cached_tokens": self.cached_tokens, "completion_tokens": self.completion_tokens,
                "hit_rate": self.cached_tokens / self.prompt_tokens if self.prompt_tokens else None,
                "ttft_s": self.ttft_s.snapshot()}


@dataclass
class RequestCounters:
    """Totals since start, reported by `/admin/metrics` and `/metrics`.

    Latencies are seen from the client's side of the engine: TTFT from the request's arrival to
    its first token leaving, TPOT the mean gap between its later tokens, e2e to the last byte.
    Only generation requests (those that report usage) enter them.
    """

    requests_total: int = 0
    requests_in_flight: int = 0
    client_disconnects: int = 0
    prompt_tokens_total: int = 0
    cached_tokens_total: int = 0
    completion_tokens_total: int = 0
    by_status: Counter[int] = field(default_factory=Counter)
    by_path: Counter[str] = field(default_factory=Counter)
    ttft_s: Histogram = field(default_factory=lambda: Histogram(SECONDS))
    tpot_s: Histogram = field(default_factory=lambda: Histogram(SECONDS))
    e2e_s: Histogram = field(default_factory=lambda: Histogram(SECONDS))
    tenants: dict[str, TenantCounters] = field(default_factory=dict)

    def tenant(self, name: str) -> TenantCounters:
        counters = self.tenants.get(name)
        if counters is None:
            if len(self.tenants) >= MAX_TENANT_LABELS:
                name = "other"
            counters = self.tenants.setdefault(name, TenantCounters())
        return counters

    def record_generation(self, tenant: str, status: int, usage: dict[str, int], ttft_s: float | None,
                          duration_s: float) -> None:
        """Add one generation request's figures (called once it ended)."""
        t = self.tenant(tenant)
        t.requests += 1
        t.errors += status >= 400
        t.prompt_tokens += usage.get("prompt_tokens", 0)
        t.cached_tokens += usage.get("cached_tokens", 0)
        t.completion_tokens += usage.get("completion_tokens", 0)
        if status >= 400 or ttft_s is None:
            return
        self.ttft_s.observe(ttft_s)
        t.ttft_s.observe(ttft_s)
        self.e2e_s.observe(duration_s)
        tokens = usage.get("completion_tokens", 0)
        if tokens > 1:
            self.tpot_s.observe(max(0.0, duration_s - ttft_s) / (tokens - 1))

    def snapshot(self) -> dict[str, Any]:
        return {
            "requests_total": self.requests_total,
            "requests_in_flight": self.requests_in_flight,
            "client_disconnects": self.client_disconnects,
            "prompt_tokens_total": self.prompt_tokens_total,
            "cached_tokens_total": self.cached_tokens_total,
            "completion_tokens_total": self.completion_tokens_total,
            "by_status": {str(k): v for k, v in sorted(self.by_status.items())},
            "by_path": dict(sorted(self.by_path.items())),
            "ttft_s": self.ttft_s.snapshot(),
            "tpot_s": self.tpot_s.snapshot(),
            "e2e_s": self.e2e_s.snapshot(),
            "tenants": {name: t.snapshot() for name, t in sorted(self.tenants.items())},
        }


class AccessLogMiddleware:
    """Assign a request id (`X-Request-Id`), count the request, and log it when it ends."""

    def __init__(self, app: ASGIApp, counters: RequestCounters) -> None:
        self.app = app
        self.counters = counters

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        state = scope.setdefault("state", {})
        incoming = dict(scope["headers"]).get(b"x-request-id", b"").decode("latin-1")
        request_id = incoming if _REQUEST_ID_RE.match(incoming) else f"req-{uuid.uuid4().hex[:16]}"
        state["request_id"] = request_id
        state["arrival"] = started
        status = 500
        logged = False
        self.counters.requests_in_flight += 1

        def finish() -> None:
            nonlocal logged
            if not logged:
                logged = True
                self.counters.requests_in_flight -= 1
                self._log(scope, state, status, started)

        async def send_wrapper(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message.setdefault("headers", [])
                message["headers"] = [*message["headers"], (b"x-request-id", request_id.encode())]
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                finish()

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            finish()

    def _log(self, scope: Scope, state: dict[str, Any], status: int, started: float) -> None:
        usage = state.get("usage") or {}
        if state.get("disconnected"):
            status = 499
            self.counters.client_disconnects += 1
        elif state.get("stream_error"):
            status = int(state["stream_error"])
        counters = self.counters
        counters.requests_total += 1
        counters.by_status[status] += 1
        counters.by_path[route_label(scope)] += 1
        counters.prompt_tokens_total += usage.get("prompt_tokens", 0)
        counters.cached_tokens_total += usage.get("cached_tokens", 0)
        counters.completion_tokens_total += usage.get("completion_tokens", 0)
        ttft = state.get("ttft_s")
        duration = time.perf_counter() - started
        if "usage" in state or ttft is not None:
            counters.record_generation(state.get("tenant", "-"), status, usage, ttft, duration)
        fields = {
            "request_id": state.get("request_id"),
            "completion_id": state.get("completion_id"),
            "tenant": state.get("tenant", "-"),
            "method": scope["method"],
            "path": scope["path"],
            "status": status,
            "prompt_tokens": usage.get("prompt_tokens"),
            "completion_tokens": usage.get("completion_tokens"),
            "cached_tokens": usage.get("cached_tokens"),
            "ttft_ms": None if ttft is None else round(ttft * 1000, 1),
            "duration_ms": round(duration * 1000, 1),
        }
        level = logging.DEBUG if scope["path"] in QUIET_PATHS else logging.INFO
        if access_logger.isEnabledFor(level):
            line = " ".join(f"{k}={v}" for k, v in fields.items() if v is not None)
            access_logger.log(level, line, extra={"access": fields})
