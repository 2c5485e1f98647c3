"""Replica exceptions, and the ONE table that maps them to HTTP answers.

Handlers raise these; ``install_handlers(app)`` turns each into an ``ErrorBody`` JSON answer with
the status from ``STATUS``. Lower layers' errors are translated at the boundary, ``from exc``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from common.protocol import ErrorBody, ErrorType


class ReplicaError(Exception):
    """Base of every error a client may see; ``message`` is shown to the client."""

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class InvalidRequest(ReplicaError):
    """400: a limit or a rule the request broke; the message names the limit and the value."""


class PayloadTooLarge(ReplicaError):
    """413: the request body is larger than max_body_bytes (a long prompt is a 400)."""


class QueueFull(ReplicaError):
    """429: every slot busy and the waiting queue full."""

    def __init__(self, message: str, *, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class NotReady(ReplicaError):
    """503: loading, draining, or failed to load."""


class QueueTimeout(ReplicaError):
    """503: waited in the queue longer than queue_timeout_s."""


class EngineOutOfMemory(ReplicaError):
    """503: the device ran out of memory for this request; the replica stays up."""


class GenerationTimeout(ReplicaError):
    """504: generation passed request_timeout_s and was stopped."""


class ClientDisconnected(ReplicaError):
    """499 (logged only): the client went away before its answer was ready."""


class ModelLoadError(Exception):
    """The model source is missing or broken; raised at start-up, names the source."""


# --- the table: exception -> (status, OpenAI error type, code) -----------------------------

STATUS: dict[type[ReplicaError], tuple[int, ErrorType, str]] = {
    InvalidRequest: (400, "invalid_request_error", "invalid_request"),
    PayloadTooLarge: (413, "invalid_request_error", "payload_too_large"),
    QueueFull: (429, "rate_limit_error", "queue_full"),
    NotReady: (503, "service_unavailable", "not_ready"),
    QueueTimeout: (503, "service_unavailable", "queue_timeout"),
    EngineOutOfMemory: (503, "service_unavailable", "out_of_memory"),
    GenerationTimeout: (504, "timeout_error", "generation_timeout"),
    ClientDisconnected: (499, "invalid_request_error", "client_closed_request"),
}

_HTTP_TYPES: dict[int, ErrorType] = {
    401: "authentication_error",
    404: "not_found_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable",
    504: "timeout_error",
}

log = logging.getLogger("replica.errors")


def describe(exc: ReplicaError) -> tuple[int, ErrorBody, dict[str, str]]:
    """Status, body and extra headers for one of our exceptions (also used for SSE errors)."""
    status, code = 500, "internal_error"
    type_: ErrorType = "server_error"
    for cls in type(exc).__mro__:
        if cls in STATUS:
            status, type_, code = STATUS[cls]
            break
    headers = {}
    if isinstance(exc, QueueFull):
        headers["Retry-After"] = str(max(1, exc.retry_after_s))
    return status, ErrorBody.make(exc.message, type_, code=code, param=exc.param), headers


def _json(status: int, body: ErrorBody, headers: Mapping[str, str] | None = None) -> JSONResponse:
    return JSONResponse(body.model_dump(), status_code=status, headers=dict(headers or {}))


def _got(err: Mapping[str, Any]) -> str:
    """``, got VALUE`` for a scalar input (so the message names the value), else ``""``."""
    value = err.get("input")
    if err.get("type") == "missing" or not isinstance(value, (str, int, float)):
        return ""
    shown = repr(value)
    return f", got {shown if len(shown) <= 40 else shown[:37] + '...'}"


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """(message, param) naming each bad field (the first five) and its value."""
    problems = []
    param = None
    for err in exc.errors():
        loc = [str(p) for p in err.get("loc", ()) if p not in ("body",)]
        field = ".".join(loc) or "body"
        param = param or field
        problems.append(f"{field}: {err.get('msg', 'invalid')}{_got(err)}")
    return "invalid request: " + "; ".join(problems[:5]), param


def install_handlers(app: FastAPI) -> None:
    """Every error answer is an ErrorBody; statuses come from STATUS above."""

    async def replica_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, ReplicaError)
        status, body, headers = describe(exc)
        return _json(status, body, headers)

    async def validation_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestValidationError)
        message, param = _validation_message(exc)
        body = ErrorBody.make(message, "invalid_request_error", code="invalid_value", param=param)
        return _json(422, body)

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, StarletteHTTPException)
        type_ = _HTTP_TYPES.get(exc.status_code, "invalid_request_error")
        body = ErrorBody.make(str(exc.detail), type_, code=str(exc.status_code))
        return _json(exc.status_code, body, exc.headers)

    async def unexpected(request: Request, exc: Exception) -> Response:
        log.error("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
        body = ErrorBody.make(
            f"internal error: {type(exc).__name__}", "server_error", code="internal_error"
        )
        return _json(500, body)

    app.add_exception_handler(ReplicaError, replica_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(Exception, unexpected)
