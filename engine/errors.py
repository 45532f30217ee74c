"""Typed engine errors: the HTTP layer maps each one to an OpenAI error response.

Three kinds of failure, three mechanisms (see STYLE.md): running out of room is a return value
inside the engine, a broken invariant is an assertion, and bad client input is one of these.
"""

from __future__ import annotations


class EngineError(Exception):
    """Base class of every error the engine raises towards its callers."""

    status_code = 500
    error_type = "server_error"

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


class InvalidRequestError(EngineError):
    """The request is malformed or its values are out of range (HTTP 400)."""

    status_code = 400
    error_type = "invalid_request_error"


class PromptTooLongError(InvalidRequestError):
    """Prompt plus requested output does not fit the model's context (HTTP 400)."""

    def __init__(self, message: str, param: str | None = "messages") -> None:
        super().__init__(message, param=param, code="context_length_exceeded")


class EngineOverloadedError(EngineError):
    """Too many requests are waiting; the client should retry later (HTTP 429)."""

    status_code = 429
    error_type = "rate_limit_error"

    def __init__(self, message: str, retry_after_s: float = 1.0) -> None:
        super().__init__(message, code="queue_full")
        self.retry_after_s = retry_after_s


class EngineNotReadyError(EngineError):
    """The engine is not started, is loading, or is shutting down (HTTP 503)."""

    status_code = 503
    error_type = "service_unavailable"


class EngineDeadError(EngineNotReadyError):
    """The engine process died; requests in flight fail and new ones wait for a restart (HTTP 503)."""
