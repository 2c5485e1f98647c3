"""Small ASGI and HTTP helpers of the proxy: headers in and out, whole answers, SSE errors."""

from __future__ import annotations

import json

import httpx
from starlette.types import Message, Scope, Send

from common.protocol import ErrorBody

# Request headers forwarded to a replica (the client's Authorization is the router's business;
# X-Request-ID is the one the router settled on, which replaces a malformed one).
FORWARD = {b"content-type", b"content-encoding", b"accept", b"user-agent"}
# Response headers not passed back (hop-by-hop, or set by our own server/middleware).
DROP = {
    b"connection",
    b"keep-alive",
    b"transfer-encoding",
    b"content-length",
    b"server",
    b"date",
    b"x-request-id",
}


async def no_receive() -> Message:
    return {"type": "http.disconnect"}


def header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key == name:
            return bytes(value).decode("latin-1")
    return None


def forwarded_headers(scope: Scope, request_id: str) -> list[tuple[bytes, bytes]]:
    headers = [(k, v) for k, v in scope["headers"] if k in FORWARD]
    if request_id:
        headers.append((b"x-request-id", request_id.encode()))
    return headers


def passed_headers(response: httpx.Response) -> list[tuple[bytes, bytes]]:
    return [(k, v) for k, v in response.headers.raw if k.lower() not in DROP]


async def send_whole(
    send: Send,
    status: int,
    headers: list[tuple[bytes, bytes]],
    body: bytes,
    length: str | None = None,
) -> None:
    """The whole answer at once; ``length`` keeps a HEAD answer's Content-Length (no body)."""
    headers = [*headers, (b"content-length", (length or str(len(body))).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def sse_error(message: str) -> bytes:
    """An SSE event the openai SDK raises as an APIError (a cut stream must not look complete)."""
    body = ErrorBody.make(message, "upstream_error", code="stream_interrupted")
    return b"data: " + json.dumps(body.model_dump()).encode() + b"\n\n"


def describe(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
