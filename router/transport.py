"""A lean HTTP/1.1 keep-alive transport for the router's ``httpx.AsyncClient``.

The router talks to a handful of replicas over plain HTTP/1.1, at high rates; httpx's default
transport (httpcore on anyio, h11) cost most of the router's CPU (see docs/BENCHMARKS.md: its
pool probes every idle socket twice per request, and anyio cancel scopes and h11 add more).
This transport keeps a LIFO stack of idle connections per replica, runs each as an asyncio
``Protocol`` with the ``httptools`` parser (uvicorn's), and streams the body as it arrives.
It is an ``httpx.AsyncBaseTransport`` raising httpx's exceptions, so callers see plain httpx.
Plain HTTP only: ``https://`` replicas (remote, behind TLS) go through httpx's own transport.

Rules: a connection is reused only after a complete response that allows keep-alive; idle ones
expire after ``keepalive_expiry`` (4 s, below uvicorn's 5 s keep-alive timeout, so the router
never writes to a connection the replica is closing); a response abandoned before its end
closes its connection (which the replica sees as a client disconnect, and cancels).
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import AsyncIterator
from typing import Any, cast

import httptools
import httpx

_HIGH_WATER = 1 << 20  # pause reading from a replica when this much body is unread
_LOW_WATER = 1 << 18

Key = tuple[str, int]


class _ClosedBeforeAnswer(httpx.RemoteProtocolError):
    """The replica closed the connection before the response head."""


class _Connection(asyncio.Protocol):
    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.closed = False
        self.idle_since = 0.0
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.keep_alive = False
        self.complete = False
        self.head_done = False
        # No Content-Length and not chunked: the body ends when the replica closes.
        self.until_close = False
        self.error: Exception | None = None
        self.chunks: collections.deque[bytes] = collections.deque()
        self.buffered = 0
        self.paused = False
        self.waiter: asyncio.Future[None] | None = None

    # ---- asyncio.Protocol --------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports do not subclass asyncio.Transport but have its methods.
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(httpx.RemoteProtocolError(f"invalid HTTP response: {exc}"))
            self.close()
            return
        if self.buffered > _HIGH_WATER and not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.until_close and exc is None and self.error is None:
            self.complete = True  # the close is the end of this body
            self._wake()
        if not self.complete:
            suffix = f" ({exc})" if exc is not None else ""
            if self.head_done:
                self._fail(
                    httpx.RemoteProtocolError(
                        "replica closed the connection in the middle of the response body" + suffix
                    )
                )
            else:
                self._fail(
                    _ClosedBeforeAnswer(
                        "replica closed the connection without sending a response" + suffix
                    )
                )

    # ---- httptools callbacks -----------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        self.head_done = True
        names = {name.lower() for name, _ in self.headers}
        self.until_close = (
            self.status >= 200
            and self.status not in (204, 304)
            and b"content-length" not in names
            and b"transfer-encoding" not in names
        )
        self._wake()

    def on_body(self, body: bytes) -> None:
        self.chunks.append(body)
        self.buffered += len(body)
        self._wake()

    def on_message_complete(self) -> None:
        self.keep_alive = self.parser.should_keep_alive()
        self.complete = True
        self._wake()

    # ---- used by the transport ---------------------------------------------------------

    def _wake(self) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _fail(self, error: Exception) -> None:
        if self.error is None:
            self.error = error
        self._wake()

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    def reusable(self) -> bool:
        return self.complete and self.keep_alive and not self.closed and self.error is None

    async def wait(self, timeout_s: float | None) -> None:
        """Until the parser made progress (or failed); ReadTimeout after ``timeout_s``."""
        if self.error is not None:
            raise self.error
        self.waiter = asyncio.get_running_loop().create_future()
        try:
            async with asyncio.timeout(timeout_s):
                await self.waiter
        except TimeoutError as exc:
            raise httpx.ReadTimeout(f"no data from the replica for {timeout_s:g}s") from exc
        finally:
            self.waiter = None

    def start(self, payload: bytes) -> None:
        self.status, self.headers, self.chunks = 0, [], collections.deque()
        self.complete = self.head_done = self.keep_alive = self.until_close = False
        self.buffered = 0
        if self.paused and self.transport is not None:
            # The last answer was left unread past the high-water mark: read again.
            self.paused = False
            self.transport.resume_reading()
        assert self.transport is not None
        self.transport.write(payload)

    def take_chunk(self) -> bytes:
        chunk = self.chunks.popleft()
        self.buffered -= len(chunk)
        if self.paused and self.buffered < _LOW_WATER and self.transport is not None:
            self.paused = False
            self.transport.resume_reading()
        return chunk


class _Body(httpx.AsyncByteStream):
    def __init__(
        self, transport: KeepAliveTransport, key: Key, conn: _Connection, timeout: float | None
    ) -> None:
        self._transport = transport
        self._key = key
        self._conn = conn
        self._timeout = timeout
        self._released = False

    async def __aiter__(self) -> AsyncIterator[bytes]:
        conn = self._conn
        while True:
            while conn.chunks:
                yield conn.take_chunk()
            if conn.complete:
                return
            await conn.wait(self._timeout)

    async def aclose(self) -> None:
        if not self._released:
            self._released = True
            self._transport._release(self._key, self._conn)


class KeepAliveTransport(httpx.AsyncBaseTransport):
    def __init__(self, *, keepalive_expiry: float = 4.0, max_idle_per_host: int = 512) -> None:
        self._keepalive_expiry = keepalive_expiry
        self._max_idle = max_idle_per_host
        self._idle: dict[Key, list[_Connection]] = {}
        self._closed = False
        self._tls: httpx.AsyncHTTPTransport | None = None

    def _take(self, key: Key) -> _Connection | None:
        stack = self._idle.get(key)
        now = time.monotonic()
        while stack:
            conn = stack.pop()
            if not conn.closed and now - conn.idle_since < self._keepalive_expiry:
                return conn
            conn.close()
        return None

    def _release(self, key: Key, conn: _Connection) -> None:
        stack = self._idle.setdefault(key, [])
        if not self._closed and conn.reusable() and len(stack) < self._max_idle:
            conn.idle_since = time.monotonic()
            stack.append(conn)
        else:
            conn.close()

    async def _connect(self, key: Key, timeout_s: float | None) -> _Connection:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(timeout_s):
                _, conn = await loop.create_connection(_Connection, key[0], key[1])
        except TimeoutError as exc:
            raise httpx.ConnectTimeout(f"connecting to {key[0]}:{key[1]} timed out") from exc
        except OSError as exc:
            raise httpx.ConnectError(f"connecting to {key[0]}:{key[1]}: {exc}") from exc
        return conn

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        url = request.url
        if url.scheme != "http":
            # TLS (a remote replica behind https): httpx's own transport does it.
            if self._tls is None:
                self._tls = httpx.AsyncHTTPTransport(
                    limits=httpx.Limits(keepalive_expiry=self._keepalive_expiry)
                )
            return await self._tls.handle_async_request(request)
        timeouts: dict[str, Any] = request.extensions.get("timeout", {})
        key: Key = (url.host, url.port or 80)
        body = await request.aread()
        head = [f"{request.method} ".encode(), url.raw_path, b" HTTP/1.1\r\n"]
        chunked = False
        for name, value in request.headers.raw:
            head += [name, b": ", value, b"\r\n"]
            chunked = chunked or name.lower() == b"transfer-encoding"
        head.append(b"\r\n")
        if chunked:
            # A streamed request body (httpx announced it chunked): read whole, sent as one chunk.
            body = (b"%x\r\n%b\r\n" % (len(body), body) if body else b"") + b"0\r\n\r\n"
        payload = b"".join(head) + body
        reused = self._take(key)
        conn = reused or await self._connect(key, timeouts.get("connect"))
        read_timeout = timeouts.get("read")
        try:
            conn.start(payload)
            while not conn.head_done:
                await conn.wait(read_timeout)
            if request.method == "HEAD":
                # No body follows whatever Content-Length says; the parser cannot be told so,
                # so the connection is not reused.
                conn.until_close = conn.keep_alive = False
                conn.chunks.clear()
                conn.complete = True
        except _ClosedBeforeAnswer as exc:
            conn.close()
            if reused is None:
                # A new connection closed before any answer: the replica is going down (or
                # is not an HTTP server), as good as a refused connection.
                raise httpx.ConnectError(f"{key[0]}:{key[1]}: {exc}") from exc
            raise
        except BaseException:
            conn.close()
            raise
        return httpx.Response(
            status_code=conn.status,
            headers=conn.headers,
            stream=_Body(self, key, conn, read_timeout),
            request=request,
        )

    async def aclose(self) -> None:
        self._closed = True
        for stack in self._idle.values():
            for conn in stack:
                conn.close()
            stack.clear()
        if self._tls is not None:
            await self._tls.aclose()
