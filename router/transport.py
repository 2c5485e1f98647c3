"""A lean keep-alive transport for the router's ``httpx.AsyncClient``.

httpx's default pool (httpcore ``AsyncConnectionPool``) re-examines every pooled connection,
probing each idle socket with a syscall, twice per request; with the 30-100 connections a busy
router keeps to its replicas that scan was ~35% of the router's CPU (see docs/BENCHMARKS.md).
This transport keeps a LIFO stack of idle HTTP/1.1 connections per replica and checks only the
one it takes. Connections are httpcore's own (h11), and httpcore errors are translated into the
httpx exceptions the proxy already handles, so the client API does not change.

Idle connections expire after ``keepalive_expiry`` (default 4 s, below uvicorn's 5 s keep-alive
timeout), so the router never reuses a connection the replica is about to close.
"""

from __future__ import annotations

import contextlib
import ssl
from collections.abc import AsyncIterator
from typing import Any

import httpcore
import httpx

_ERRORS: dict[type[Exception], type[httpx.TransportError]] = {
    httpcore.ConnectTimeout: httpx.ConnectTimeout,
    httpcore.ReadTimeout: httpx.ReadTimeout,
    httpcore.WriteTimeout: httpx.WriteTimeout,
    httpcore.PoolTimeout: httpx.PoolTimeout,
    httpcore.TimeoutException: httpx.TimeoutException,
    httpcore.ConnectError: httpx.ConnectError,
    httpcore.ReadError: httpx.ReadError,
    httpcore.WriteError: httpx.WriteError,
    httpcore.NetworkError: httpx.NetworkError,
    httpcore.RemoteProtocolError: httpx.RemoteProtocolError,
    httpcore.LocalProtocolError: httpx.LocalProtocolError,
    httpcore.ProtocolError: httpx.ProtocolError,
    httpcore.UnsupportedProtocol: httpx.UnsupportedProtocol,
}

Key = tuple[bytes, bytes, int]


def _translate(exc: Exception, request: httpx.Request) -> Exception:
    for core_type in type(exc).__mro__:
        mapped = _ERRORS.get(core_type)  # type: ignore[call-overload]
        if mapped is not None:
            return mapped(str(exc) or type(exc).__name__, request=request)
    return exc


class _Stream(httpx.AsyncByteStream):
    """The response body; on close, its connection goes back to the idle stack if reusable."""

    def __init__(
        self,
        transport: KeepAliveTransport,
        key: Key,
        connection: httpcore.AsyncHTTPConnection,
        stream: Any,
        request: httpx.Request,
    ) -> None:
        self._transport = transport
        self._key = key
        self._connection = connection
        self._stream = stream
        self._request = request

    async def __aiter__(self) -> AsyncIterator[bytes]:
        try:
            async for part in self._stream:
                yield part
        except httpcore.TimeoutException as exc:
            raise _translate(exc, self._request) from exc
        except (httpcore.NetworkError, httpcore.ProtocolError) as exc:
            raise _translate(exc, self._request) from exc

    async def aclose(self) -> None:
        try:
            if hasattr(self._stream, "aclose"):
                await self._stream.aclose()
        finally:
            self._transport._release(self._key, self._connection)


class KeepAliveTransport(httpx.AsyncBaseTransport):
    def __init__(
        self,
        *,
        keepalive_expiry: float = 4.0,
        max_idle_per_host: int = 512,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        self._keepalive_expiry = keepalive_expiry
        self._max_idle = max_idle_per_host
        self._ssl_context = ssl_context
        self._idle: dict[Key, list[httpcore.AsyncHTTPConnection]] = {}
        # Connections to close at the next await point (release happens in sync code).
        self._discard: list[httpcore.AsyncHTTPConnection] = []
        self._closed = False

    def _take(self, key: Key) -> httpcore.AsyncHTTPConnection | None:
        stack = self._idle.get(key)
        while stack:
            connection = stack.pop()
            if connection.is_idle() and not connection.has_expired():
                return connection
            self._discard.append(connection)
        return None

    def _release(self, key: Key, connection: httpcore.AsyncHTTPConnection) -> None:
        stack = self._idle.setdefault(key, [])
        if not self._closed and connection.is_idle() and len(stack) < self._max_idle:
            stack.append(connection)
        elif not connection.is_closed():
            self._discard.append(connection)

    async def _close_discarded(self) -> None:
        while self._discard:
            connection = self._discard.pop()
            with contextlib.suppress(Exception):  # a dead socket may fail to close: gone anyway
                await connection.aclose()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        url = request.url
        key: Key = (
            url.raw_scheme,
            url.raw_host,
            url.port or (443 if url.scheme == "https" else 80),
        )
        connection = self._take(key)
        if self._discard:
            await self._close_discarded()
        if connection is None:
            connection = httpcore.AsyncHTTPConnection(
                origin=httpcore.Origin(*key),
                keepalive_expiry=self._keepalive_expiry,
                ssl_context=self._ssl_context,
            )
        core_request = httpcore.Request(
            method=request.method,
            url=httpcore.URL(
                scheme=url.raw_scheme, host=url.raw_host, port=url.port, target=url.raw_path
            ),
            headers=request.headers.raw,
            content=request.stream,  # type: ignore[arg-type]
            extensions=request.extensions,
        )
        try:
            response = await connection.handle_async_request(core_request)
        except Exception as exc:
            await connection.aclose()
            raise _translate(exc, request) from exc
        except BaseException:
            await connection.aclose()
            raise
        return httpx.Response(
            status_code=response.status,
            headers=response.headers,
            stream=_Stream(self, key, connection, response.stream, request),
            extensions=response.extensions,
        )

    async def aclose(self) -> None:
        self._closed = True
        for stack in self._idle.values():
            self._discard.extend(stack)
            stack.clear()
        await self._close_discarded()
