"""Every failure leaves the server as `ErrorResponse` with the right HTTP status.

Engine errors carry their own status and type (`engine.errors`); the HTTP layer adds its own
(`APIError` subclasses), turns FastAPI's 422 validation errors and malformed JSON into 400s, and
enforces the body size limit in a small ASGI middleware that never buffers more than the limit.
"""

from __future__ import annotations

import asyncio
import logging
import math
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.protocol import ErrorDetail, ErrorResponse
from engine.errors import EngineError, EngineNotReadyError, EngineOverloadedError
from engine.heap import release_freed_memory

logger = logging.getLogger(__name__)

_STATUS_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 403: "permission_error",
                 404: "invalid_request_error", 405: "invalid_request_error", 409: "invalid_request_error",
                 413: "invalid_request_error", 429: "rate_limit_error", 503: "service_unavailable",
                 504: "timeout_error"}


_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "none", "dict", "list"})


class APIError(Exception):
    """An error raised by the HTTP layer itself, rendered as `ErrorResponse`."""

    status_code = 400
    error_type = "invalid_request_error"

    def __init__(self, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers


class AuthenticationError(APIError):
    status_code = 401

    def __init__(self, message: str) -> None:
        super().__init__(message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


class RateLimitError(APIError):
    """429 for a tenant over one of its limits (`tenants.limits`), with `Retry-After`."""

    status_code = 429
    error_type = "rate_limit_error"

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message, code="rate_limit_exceeded",
                         headers={"Retry-After": str(max(1, math.ceil(retry_after_s)))})


class PermissionDeniedError(APIError):
    """403: the key is valid but may not do this (e.g. a tenant's key acting for another tenant)."""

    status_code = 403
    error_type = "permission_error"


class ConflictError(APIError):
    """409: the request is valid but the server's state refuses it (e.g. a pin past a quota)."""

    status_code = 409


class GatewayTimeoutError(APIError):
    """504: the engine or a cache tier did not answer in time; the request may be retried."""

    status_code = 504
    error_type = "timeout_error"


class NotFoundError(APIError):
    status_code = 404

    def __init__(self, message: str) -> None:
        super().__init__(message, code="not_found")


class ModelNotFoundError(APIError):
    status_code = 404

    def __init__(self, model: str) -> None:
        super().__init__(f"The model `{model}` does not exist or you do not have access to it.",
                         param="model", code="model_not_found")


def _printable(text: str | None) -> str | None:
    """`text` with anything UTF-8 cannot encode (lone surrogates a client sent) escaped."""
    if text is None or text.isascii():
        return text
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def error_body(message: str, error_type: str, param: str | None = None, code: str | None = None) -> dict:
    return ErrorResponse(error=ErrorDetail(message=_printable(message) or "", type=error_type,
                                           param=_printable(param), code=code)).model_dump()


def error_response(status: int, message: str, error_type: str | None = None, param: str | None = None,
                   code: str | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    error_type = error_type or _STATUS_TYPES.get(status, "server_error" if status >= 500 else
                                                 "invalid_request_error")
    return JSONResponse(error_body(message, error_type, param, code), status_code=status, headers=headers)


def engine_error_response(exc: EngineError) -> JSONResponse:
    headers = None
    if isinstance(exc, EngineOverloadedError):
        headers = {"Retry-After": str(max(1, math.ceil(exc.retry_after_s)))}
    elif isinstance(exc, EngineNotReadyError):
        headers = {"Retry-After": "5"}  # loading, restarting or draining: seconds, not minutes
    return error_response(exc.status_code, exc.message, exc.error_type, exc.param, exc.code, headers)


def _param_from_loc(loc: tuple) -> str | None:
    parts = list(loc[1:] if loc and loc[0] == "body" else loc)
    # pydantic names the union member it tried ("list[int]", "str"): not part of the path
    parts = [p for p in parts if isinstance(p, int) or ("[" not in p and p not in _TYPE_TAGS)]
    param = ""
    for part in parts:
        param += f"[{part}]" if isinstance(part, int) else (f".{part}" if param else part)
    return param or None


def _validation_response(exc: RequestValidationError) -> JSONResponse:
    errors: list[dict[str, Any]] = [dict(e) for e in exc.errors()]
    first: dict[str, Any] = errors[0] if errors else {"loc": (), "msg": "invalid request", "type": ""}
    if first.get("type") == "json_invalid":
        detail = first.get("ctx", {}).get("error", "")
        return error_response(400, f"Invalid JSON body: {detail}".rstrip(": "), code="invalid_json")
    param = _param_from_loc(tuple(first.get("loc", ())))
    if first.get("type") == "extra_forbidden":
        return error_response(400, f"Unrecognized request argument supplied: {param}", param=param,
                              code="unknown_parameter")
    if param is None and first.get("type") == "missing":
        return error_response(400, "A JSON request body is required.")
    if param is None and first.get("type") in ("model_attributes_type", "dict_type"):
        return error_response(400, "The request body must be a JSON object.")
    # a union (prompt, content) fails once per member: report every member's complaint
    messages = list(dict.fromkeys(str(e.get("msg")) for e in errors
                                  if _param_from_loc(tuple(e.get("loc", ()))) == param))
    detail = "; or ".join(messages) if messages else str(first.get("msg"))
    message = f"Invalid value for '{param}': {detail}" if param else detail
    return error_response(400, message, param=param, code="invalid_value")


def install_exception_handlers(app: FastAPI) -> None:
    """Route every exception the app can raise to an `ErrorResponse`."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc.status_code, exc.message, exc.error_type, exc.param, exc.code, exc.headers)

    @app.exception_handler(EngineError)
    async def _engine_error(request: Request, exc: EngineError) -> JSONResponse:
        return engine_error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _validation_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            message = f"Invalid URL ({request.method} {request.url.path})"
        elif exc.status_code == 405:
            message = f"Method {request.method} not allowed for {request.url.path}"
        else:
            message = str(exc.detail)
        return error_response(exc.status_code, message, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error path=%s", request.url.path)
        return error_response(500, "The server had an error while processing your request.",
                              "server_error")


TRIM_AFTER_BYTES = 1 << 20  # bodies this large are followed by a malloc_trim (see below)

class BodySizeLimitMiddleware:
    """Reject request bodies over `max_bytes` with 413 before the app reads them.

    A declared `Content-Length` over the limit is refused at once; otherwise the body is read in
    its chunks, at most `max_bytes` of it kept, and replayed to the app as one message.
    """

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self._trim: asyncio.TimerHandle | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._reject(scope, receive, send)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # client went away before sending the body
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await self._reject(scope, receive, send)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        try:
            await self.app(scope, replay, send)
        finally:
            if size >= TRIM_AFTER_BYTES:
                chunks.clear()
                self._schedule_trim()

    def _schedule_trim(self) -> None:
        """Give the memory of large bodies back to the OS shortly after the last one is done.

        CPython hands blocks this large to malloc, and glibc keeps what is freed in its arenas, so
        without a trim a burst of multi-MB prompts leaves the process tens of MB larger for good.
        """
        if self._trim is not None:
            self._trim.cancel()
        self._trim = asyncio.get_running_loop().call_later(0.2, release_freed_memory)

    async def _reject(self, scope: Scope, receive: Receive, send: Send) -> None:
        message = f"Request body too large: the limit is {self.max_bytes} bytes."
        response = error_response(413, message, code="request_too_large", headers={"Connection": "close"})
        await response(scope, receive, send)
