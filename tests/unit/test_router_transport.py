"""The router's HTTP/1.1 transport against scripted servers on loopback: keep-alive reuse,
chunked bodies, early closes, timeouts, connection refused."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

import httpx
import pytest

from router.transport import KeepAliveTransport

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


class Server:
    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.connections = 0
        self.server: asyncio.Server | None = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            await self.handler(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    async def __aenter__(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = self.server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()


async def read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":")[1])
    body = await reader.readexactly(length) if length else b""
    return head + body


def ok(body: bytes, extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n%s\r\n%s" % (len(body), extra, body)


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(transport=KeepAliveTransport(), timeout=5) as c:
        yield c


async def test_keep_alive_reuses_one_connection(client: httpx.AsyncClient) -> None:
    seen: list[bytes] = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            seen.append(await read_request(reader))
            writer.write(ok(b'{"n": %d}' % len(seen)))

    server = Server(handler)
    async with server as url:
        for i in range(1, 4):
            r = await client.post(url + "/generate?x=1", json={"text": "hi"})
            assert r.status_code == 200 and r.json() == {"n": i}
    assert server.connections == 1
    assert seen[0].startswith(b"POST /generate?x=1 HTTP/1.1\r\n")
    assert b'{"text":"hi"}' in seen[0] or b'{"text": "hi"}' in seen[0]


async def test_chunked_stream_arrives_piece_by_piece(client: httpx.AsyncClient) -> None:
    step = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n"
        )
        writer.write(b"7\r\ndata: 1\r\n")
        await writer.drain()
        await step.wait()  # the second piece only after the client saw the first
        writer.write(b"7\r\ndata: 2\r\n0\r\n\r\n")
        await writer.drain()
        await reader.read()  # keep the connection open until the client is done

    async with Server(handler) as url, client.stream("GET", url + "/s") as r:
        pieces = r.aiter_raw()
        assert await anext(pieces) == b"data: 1"
        step.set()
        rest = [p async for p in pieces]
    assert b"".join(rest) == b"data: 2"


async def test_connection_close_is_not_reused(client: httpx.AsyncClient) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(ok(b"bye", b"Connection: close\r\n"))
        await writer.drain()

    server = Server(handler)
    async with server as url:
        assert (await client.get(url + "/")).text == "bye"
        assert (await client.get(url + "/")).text == "bye"
    assert server.connections == 2


async def test_close_before_an_answer_and_mid_body(client: httpx.AsyncClient) -> None:
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)

    async with Server(silent) as url:
        # On a new connection that is as good as refused (the replica is going down)...
        with pytest.raises(httpx.ConnectError, match="without sending a response"):
            await client.get(url + "/")

    async def once(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(ok(b"first"))
        await writer.drain()
        await read_request(reader)  # the second request on this connection: no answer

    async with Server(once) as url:
        assert (await client.get(url + "/")).text == "first"
        # ...on a kept-alive one it may be a close racing the request: a protocol error.
        with pytest.raises(httpx.RemoteProtocolError, match="without sending a response"):
            await client.get(url + "/")

    async def cut(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\npartial")
        await writer.drain()

    async with Server(cut) as url:
        with pytest.raises(httpx.RemoteProtocolError, match="middle of the response"):
            await client.get(url + "/")


async def test_read_timeout_and_connect_refused() -> None:
    async def hang(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        await asyncio.sleep(30)

    async with httpx.AsyncClient(transport=KeepAliveTransport(), timeout=httpx.Timeout(0.3)) as c:
        async with Server(hang) as url:
            with pytest.raises(httpx.ReadTimeout):
                await c.get(url + "/")
        async with Server(hang) as url:
            pass  # closed again: nothing listens on that port now
        with pytest.raises(httpx.ConnectError):
            await c.get(url + "/")


async def test_garbage_is_a_protocol_error(client: httpx.AsyncClient) -> None:
    async def garbage(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"NOT HTTP AT ALL\r\n\r\n")
        await writer.drain()
        await reader.read()

    async with Server(garbage) as url:
        with pytest.raises(httpx.RemoteProtocolError):
            await client.get(url + "/")


async def test_https_goes_through_httpx_own_transport() -> None:
    async def hang(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()

    async with Server(hang) as url:
        pass  # nothing listens there any more
    transport = KeepAliveTransport()
    async with httpx.AsyncClient(transport=transport, timeout=2) as c:
        # Not "unsupported protocol": TLS is attempted (and the connection refused).
        with pytest.raises(httpx.ConnectError):
            await c.get(url.replace("http://", "https://") + "/health")
