"""Router exceptions, and the ONE table that maps them to HTTP answers.

Handlers and the proxy raise these; ``install_handlers(app)`` turns each into an ``ErrorBody``
JSON answer with the status from ``STATUS``. Starlette's 404/405 and FastAPI's validation errors
are answered in the same shape, so a client never sees a bare 500 or an HTML page.
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from common.protocol import ErrorBody, ErrorType


class RouterError(Exception):
    """Base of every error a client may see; ``message`` is shown to the client."""

    def __init__(self, message: str, *, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.code = code


class BadRequest(RouterError):
    """400: a body the router cannot forward (or an admin call with bad input)."""


class PayloadTooLarge(RouterError):
    """413: the body is larger than the router forwards."""


class Unauthorized(RouterError):
    """401: no key, or a key that is not one of the configured ones."""


class Forbidden(RouterError):
    """403: a valid API key on an admin route."""


class UnknownReplica(RouterError):
    """404: no replica by that name."""


class Conflict(RouterError):
    """409: a replica by that name (or URL) already exists."""


class AllReplicasBusy(RouterError):
    """429: every ready replica is full; try again after ``retry_after_s``."""

    def __init__(self, message: str, *, retry_after_s: int) -> None:
        super().__init__(message, code="all_replicas_busy")
        self.retry_after_s = retry_after_s


class NoReplicaReady(RouterError):
    """503: no replica is healthy, ready and accepting work."""


class RouterDraining(RouterError):
    """503: the router was told to drain; it takes no new requests."""


class UpstreamTimeout(RouterError):
    """504: the replica did not answer within the router's request timeout."""


STATUS: dict[type[RouterError], tuple[int, ErrorType]] = {
    BadRequest: (400, "invalid_request_error"),
    PayloadTooLarge: (413, "invalid_request_error"),
    Unauthorized: (401, "authentication_error"),
    Forbidden: (403, "authentication_error"),
    UnknownReplica: (404, "not_found_error"),
    Conflict: (409, "invalid_request_error"),
    AllReplicasBusy: (429, "rate_limit_error"),
    NoReplicaReady: (503, "service_unavailable"),
    RouterDraining: (503, "service_unavailable"),
    UpstreamTimeout: (504, "timeout_error"),
}


def status_of(exc: RouterError) -> tuple[int, ErrorType]:
    for cls in type(exc).__mro__:
        if cls in STATUS:
            return STATUS[cls]  # type: ignore[index]
    return 500, "server_error"


def error_response(exc: RouterError) -> JSONResponse:
    """The JSON answer for ``exc`` (the request-id middleware adds X-Request-ID)."""
    status, kind = status_of(exc)
    headers: dict[str, str] = {}
    if isinstance(exc, AllReplicasBusy):
        headers["Retry-After"] = str(exc.retry_after_s)
    if isinstance(exc, Unauthorized):
        headers["WWW-Authenticate"] = "Bearer"
    body = ErrorBody.make(exc.message, kind, code=exc.code)
    return JSONResponse(body.model_dump(), status_code=status, headers=headers)


_HTTP_KINDS: dict[int, ErrorType] = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
}


def install_handlers(app: FastAPI) -> None:
    async def on_router_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RouterError)
        return error_response(exc)

    async def on_http_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        kind = _HTTP_KINDS.get(exc.status_code, "server_error")
        body = ErrorBody.make(str(exc.detail), kind)
        return JSONResponse(body.model_dump(), status_code=exc.status_code)

    async def on_validation_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        message = f"{where or 'request body'}: {first.get('msg', 'invalid')}"
        body = ErrorBody.make(message, "invalid_request_error", param=where or None)
        return JSONResponse(body.model_dump(), status_code=422)

    app.add_exception_handler(RouterError, on_router_error)
    app.add_exception_handler(StarletteHTTPException, on_http_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)
