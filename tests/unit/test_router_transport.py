"""The router's HTTP/1.1 transport against scripted servers on loopback: keep-alive reuse,
chunked bodies, early closes, timeouts, connection refused."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

import h11
import httpx
import pytest

from router import transport as transport_module
from router.transport import KeepAliveTransport, _Body

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


async def test_head_answer_ends_at_its_head(client: httpx.AsyncClient) -> None:
    # A HEAD answer carries the GET's Content-Length but no body (curl -I through the router).
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            await read_request(reader)
            writer.write(b"HTTP/1.1 405 Method Not Allowed\r\nContent-Length: 31\r\n\r\n")

    server = Server(handler)
    async with server as url:
        for _ in range(2):
            r = await client.head(url + "/v1/models", timeout=3)
            assert r.status_code == 405 and r.content == b""
        assert (await client.head(url + "/", timeout=3)).status_code == 405


async def test_body_ended_by_close_is_complete(client: httpx.AsyncClient) -> None:
    # No Content-Length, not chunked: HTTP/1.0 style, the close ends the body (as with httpx).
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nuntil ")
        await writer.drain()
        writer.write(b"the end")

    server = Server(handler)
    async with server as url:
        assert (await client.get(url + "/health")).text == "until the end"
        assert (await client.get(url + "/health")).text == "until the end"
    assert server.connections == 2


async def test_streamed_request_body_is_sent_chunked(client: httpx.AsyncClient) -> None:
    received: list[object] = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = h11.Connection(h11.SERVER)
        body = b""
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                conn.receive_data(await reader.read(65536))
            elif isinstance(event, h11.Data):
                body += event.data
            elif isinstance(event, h11.EndOfMessage):
                break
        received.append(body)
        writer.write(ok(b"got it"))
        await writer.drain()

    async def pieces() -> AsyncIterator[bytes]:
        yield b'{"text": '
        yield b'"hi"}'

    async with Server(handler) as url:
        r = await client.post(url + "/generate", content=pieces())
    assert r.text == "got it"
    assert received == [b'{"text": "hi"}']


async def test_head_split_into_single_bytes_is_parsed(client: httpx.AsyncClient) -> None:
    answer = (
        b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n"
        b"\r\n5\r\nhello\r\n0\r\n\r\n"
    )

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            await read_request(reader)
            for i in range(len(answer)):
                writer.write(answer[i : i + 1])
                await writer.drain()
                await asyncio.sleep(0)

    server = Server(handler)
    async with server as url:
        for _ in range(2):
            r = await client.get(url + "/")
            assert r.status_code == 200 and r.text == "hello"
            assert r.headers["content-type"] == "text/event-stream"
    assert server.connections == 1


async def test_large_bodies_both_ways_with_backpressure() -> None:
    big = bytes(range(256)) * (32 * 1024)  # 8 MiB
    sent = asyncio.Event()

    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        body = (await read_request(reader)).split(b"\r\n\r\n", 1)[1]
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        for i in range(0, len(body), 65536):
            piece = body[i : i + 65536]
            writer.write(b"%x\r\n%b\r\n" % (len(piece), piece))
            await writer.drain()
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        sent.set()
        await reader.read()

    transport = KeepAliveTransport()
    async with Server(echo) as url:
        request = httpx.Request("POST", url + "/", content=big)
        response = await transport.handle_async_request(request)
        body = response.stream
        assert isinstance(body, _Body)
        conn = body._conn
        pieces = body.__aiter__()
        got = [await anext(pieces)]
        # The client reads nothing more: the transport stops reading from the socket once
        # about 1 MiB is buffered, so the echo cannot finish sending.
        for _ in range(500):
            if conn.paused:
                break
            await asyncio.sleep(0.01)
        assert conn.paused and not sent.is_set()
        assert conn.buffered < 2 * (1 << 20)
        got += [p async for p in pieces]
        assert not conn.paused
        await body.aclose()
        await transport.aclose()
    assert b"".join(got) == big


async def test_connections_are_reused_across_concurrent_rounds(
    client: httpx.AsyncClient,
) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            await read_request(reader)
            await asyncio.sleep(0.01)
            writer.write(ok(b"x"))

    server = Server(handler)
    async with server as url:
        for _ in range(3):
            answers = await asyncio.gather(*(client.get(url + "/") for _ in range(20)))
            assert [a.text for a in answers] == ["x"] * 20
    assert server.connections == 20


async def test_abandoned_or_cancelled_requests_close_their_connection(
    client: httpx.AsyncClient,
) -> None:
    closed = asyncio.Queue[str]()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await read_request(reader)
        if b"/stream" in head:
            writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nfirst\r\n")
            await writer.drain()
        # Never finishes the answer: waits for the router to go away (a cancel, to a replica).
        await reader.read()
        closed.put_nowait(head.split(b" ")[1].decode())

    server = Server(handler)
    async with server as url:
        async with client.stream("GET", url + "/stream") as r:
            assert await anext(r.aiter_raw()) == b"first"
        assert await asyncio.wait_for(closed.get(), 5) == "/stream"

        task = asyncio.create_task(client.get(url + "/head"))
        for _ in range(500):
            if server.connections == 2:
                break
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert await asyncio.wait_for(closed.get(), 5) == "/head"
    assert server.connections == 2


async def test_idle_connections_expire() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            await read_request(reader)
            writer.write(ok(b"x"))

    server = Server(handler)
    transport = KeepAliveTransport(keepalive_expiry=0)
    async with server as url, httpx.AsyncClient(transport=transport, timeout=5) as c:
        for _ in range(3):
            assert (await c.get(url + "/")).text == "x"
    assert server.connections == 3


async def test_a_connection_kept_while_reading_was_paused_reads_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A whole answer arrived past the high-water mark and the client left without reading it
    # (a finished stream, a slow client that disconnects): the connection is kept, and must
    # not stay paused, or the next request on it waits for ever.
    monkeypatch.setattr(transport_module, "_HIGH_WATER", 10)
    monkeypatch.setattr(transport_module, "_LOW_WATER", 5)

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            await read_request(reader)
            writer.write(ok(b"x" * 100))

    server = Server(handler)
    transport = KeepAliveTransport()
    async with server as url:
        response = await transport.handle_async_request(httpx.Request("GET", url + "/"))
        body = response.stream
        assert isinstance(body, _Body)
        for _ in range(500):
            if body._conn.complete:
                break
            await asyncio.sleep(0.01)
        assert body._conn.complete and body._conn.paused
        await body.aclose()
        async with httpx.AsyncClient(transport=transport, timeout=3) as c:
            assert (await c.get(url + "/")).text == "x" * 100
    assert server.connections == 1
