"""Forward a request to the least-loaded replica; stream the answer back without buffering.

Rules:

- Retry on a different replica after a connection failure (refused, reset, closed before an
  answer), or a 429/503 from the replica, only while no byte has gone to the client; at most
  ``max_attempts`` attempts, and retries are drawn from a ``RetryBudget``.
- A failure to connect ejects the replica at once; other failures and 5xx answers are counted
  toward outlier ejection (rules in ``router/outcomes.py``).
- Non-streaming answers are read whole before anything is sent, so a failure while reading
  one is still retried. SSE answers (``text/event-stream``) are passed through chunk by chunk;
  once one started, it is never retried: a cut ends it with ``data: {"error": {...}}``.
- Other 5xx answers are passed through as they are (the request may have run).
- A client that disconnects cancels the upstream request (the connection to the replica is
  closed, which the replica treats as a cancel).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx
from starlette.types import Message, Receive, Scope, Send

from common.config import RouterConfig
from router import wire
from router.auth import Keys
from router.budget import RetryBudget
from router.errors import (
    AllReplicasBusy,
    NoReplicaReady,
    PayloadTooLarge,
    RouterDraining,
    RouterError,
    UpstreamTimeout,
    error_response,
)
from router.health import CompletionRate
from router.metrics import RouterMetrics
from router.outcomes import Outcomes
from router.policy import Refusal, choose, refusal
from router.pool import Pool, ReplicaState

_TRANSPORT_ERRORS = (
    httpx.ConnectError,
    httpx.ConnectTimeout,
    httpx.RemoteProtocolError,
    httpx.ReadError,
    httpx.WriteError,
    httpx.CloseError,
)


# Nothing reached the replica: it is down (or unreachable), so it leaves rotation at once. A
# reset or an early close on an established connection is retried elsewhere but does not eject:
# a keep-alive connection closed by the replica at the wrong moment looks the same. A dead
# replica is ejected by the next connect anyway.
_CONNECT_ERRORS = (httpx.ConnectError, httpx.ConnectTimeout)


class _ClientGone(Exception):
    """The client disconnected; nothing more is sent."""


@dataclass
class _Stored:
    """A replica's 429/503, kept to pass through if no other replica can take the request."""

    status: int
    headers: list[tuple[bytes, bytes]]
    body: bytes


class Proxy:
    """The ASGI endpoint of every proxied route, with the router's admission state."""

    def __init__(
        self,
        pool: Pool,
        config: RouterConfig,
        *,
        metrics: RouterMetrics,
        keys: Keys,
        clock: Callable[[], float],
        rng: random.Random,
        max_body_bytes: int,
    ) -> None:
        self.pool = pool
        self.config = config
        self.metrics = metrics
        self.keys = keys
        self.clock = clock
        self.rng = rng
        self.max_body_bytes = max_body_bytes
        self.client: httpx.AsyncClient | None = None  # set by the lifespan
        # Set when the lifespan built the client on a transport it owns: proxied requests then
        # go straight to the transport, skipping the client's cookie jar (a replica's cookies
        # must not leak to other clients) and hooks, which cost ~15% of the router's CPU.
        self.transport: httpx.AsyncBaseTransport | None = None
        self.budget = RetryBudget(config.retry_budget_ratio, clock)
        self.rate = CompletionRate(clock)
        self.outcomes = Outcomes(pool, config, self.rate, clock)
        self.timeout = httpx.Timeout(
            config.request_timeout_s,
            connect=config.connect_timeout_s,
            pool=config.connect_timeout_s,
        )
        self._timeouts = self.timeout.as_dict()
        self.min_free_bytes = config.min_free_memory_mb * 1024 * 1024
        self.draining = False
        self.in_flight = 0

    # ---- the ASGI endpoint -------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        info: dict[str, Any] = scope.setdefault("state", {})
        request_id = str(info.get("request_id") or "")
        try:
            self.keys.check(wire.header(scope, b"authorization"), admin=False)
            body = await self._read_body(receive)
            if self.draining:
                self.metrics.rejections.labels("draining").inc()
                raise RouterDraining("the router is draining: it takes no new requests")
        except RouterError as exc:
            await error_response(exc)(scope, receive, send)
            return
        except _ClientGone:
            return
        self.in_flight += 1
        me = asyncio.current_task()
        state = {"gone": False, "done": False, "started": False}

        async def send_tracked(message: Message) -> None:
            if message["type"] == "http.response.start":
                state["started"] = True
            await send(message)

        watcher = asyncio.ensure_future(self._watch_disconnect(receive, me, state))
        try:
            await self._serve(scope, send_tracked, body, request_id, info, state)
        except asyncio.CancelledError:
            if me is None:
                raise
            me.uncancel()
            if state["gone"]:
                info["status_note"] = "client disconnected"
            else:  # the server cancelled us: shutdown outlived the drain timeout
                info["status_note"] = "cut by shutdown"
                await self._answer_shutdown(scope, send, state)
        except _ClientGone:
            info["status_note"] = "client disconnected"
        finally:
            state["done"] = True
            watcher.cancel()
            self.in_flight -= 1

    async def _answer_shutdown(self, scope: Scope, send: Send, state: dict[str, bool]) -> None:
        """The router is stopping and this request outlived the drain: say so, not a 500."""
        message = "the router shut down before the replica's answer ended (drain timeout)"
        with contextlib.suppress(Exception):  # the connection may be closing already
            if not state["started"]:
                self.metrics.rejections.labels("shutdown").inc()
                await error_response(RouterDraining(message))(scope, wire.no_receive, send)
            else:
                await send(
                    {
                        "type": "http.response.body",
                        "body": wire.sse_error(message),
                        "more_body": False,
                    }
                )

    async def _watch_disconnect(
        self, receive: Receive, me: asyncio.Task[Any] | None, state: dict[str, bool]
    ) -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                if not state["done"] and me is not None:
                    state["gone"] = True
                    me.cancel()
                return

    async def _read_body(self, receive: Receive) -> bytes:
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise _ClientGone
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                raise PayloadTooLarge(
                    f"request body larger than the router's limit of {self.max_body_bytes} bytes"
                )
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    # ---- one request -------------------------------------------------------------------

    async def _serve(
        self,
        scope: Scope,
        send: Send,
        body: bytes,
        request_id: str,
        info: dict[str, Any],
        state: dict[str, bool],
    ) -> None:
        path = scope["path"]
        query = scope.get("query_string", b"")
        target = path + ("?" + query.decode("latin-1") if query else "")
        headers = wire.forwarded_headers(scope, request_id)
        try:
            outcome = await self._exchange(scope["method"], target, headers, body, info)
        except RouterError as exc:
            answer = error_response(exc)
            self.metrics.requests.labels(str(answer.status_code)).inc()
            state["done"] = True  # from here on a disconnect needs no cancel
            await answer(scope, wire.no_receive, send)
            return
        if isinstance(outcome, _Stored):
            self.metrics.requests.labels(str(outcome.status)).inc()
            state["done"] = True
            await wire.send_whole(send, outcome.status, outcome.headers, outcome.body)
            return
        response, replica, content = outcome
        self.metrics.requests.labels(str(response.status_code)).inc()
        if content is not None:
            self.outcomes.finish(replica, response.status_code)
            state["done"] = True
            head = scope["method"] == "HEAD"
            length = response.headers.get("content-length") if head else None
            await wire.send_whole(
                send, response.status_code, wire.passed_headers(response), content, length
            )
            return
        await self._stream(send, response, replica, state)

    async def _exchange(
        self,
        method: str,
        target: str,
        headers: list[tuple[bytes, bytes]],
        body: bytes,
        info: dict[str, Any],
    ) -> tuple[httpx.Response, ReplicaState, bytes | None] | _Stored:
        """Find a replica that answers; the response is open (SSE) or read (content)."""
        self.budget.deposit()
        tried: list[str] = []
        stored: _Stored | None = None
        failure: str | None = None
        for attempt in range(self.config.max_attempts):
            replica = choose(
                self.pool.replicas.values(),
                self.rng,
                min_free_memory_bytes=self.min_free_bytes,
                exclude=tried,
            )
            if replica is None:
                # Full replicas not yet tried: 429; nothing else accepting: the failure, 503.
                if stored is None:
                    replicas = self.pool.list()
                    why = refusal(replicas, tried)
                    if attempt == 0 or why is Refusal.ALL_FULL:
                        raise self._refuse(replicas, why)
                break
            if attempt > 0:
                if not self.budget.try_spend():
                    self.metrics.rejections.labels("retry_budget").inc()
                    break
                self.metrics.retries.labels(info.get("retry_reason", "unknown")).inc()
            tried.append(replica.name)
            info["replica"] = replica.name
            info["attempts"] = attempt + 1
            replica.in_flight += 1
            replica.picks += 1
            started = self.clock()
            try:
                response = await self._send(method, replica.url + target, headers, body)
                self.metrics.upstream_latency.labels(replica.name).observe(self.clock() - started)
                sse = response.headers.get("content-type", "").startswith("text/event-stream")
                if sse and response.status_code < 400:
                    return response, replica, None
                try:
                    content = await response.aread()
                finally:  # also on a timeout or a cancel part-way: close, so the replica stops
                    await response.aclose()
            except _TRANSPORT_ERRORS as exc:
                self.outcomes.release(replica)
                failure = f"replica {replica.name} failed: {wire.describe(exc)}"
                if isinstance(exc, _CONNECT_ERRORS):
                    self.outcomes.eject(replica, failure)
                else:
                    self.outcomes.failed(replica, failure)
                info["retry_reason"] = "connection"
                continue
            except asyncio.CancelledError:
                self.outcomes.release(replica)
                raise
            except httpx.TimeoutException as exc:
                self.outcomes.release(replica)
                self.outcomes.failed(replica, f"timed out: {wire.describe(exc)}")
                raise UpstreamTimeout(
                    f"replica {replica.name} did not answer within "
                    f"{self.config.request_timeout_s:g}s"
                ) from exc
            status = response.status_code
            if status in (429, 503):
                self.outcomes.release(replica)
                self.outcomes.refused(replica, status)
                stored = _Stored(status, wire.passed_headers(response), content)
                info["retry_reason"] = str(status)
                continue
            return response, replica, content
        if stored is not None:
            return stored
        raise NoReplicaReady(
            f"no replica is ready: {failure or 'no replica could take the request'}"
        )

    async def _send(
        self, method: str, url: str, headers: list[tuple[bytes, bytes]], body: bytes
    ) -> httpx.Response:
        """Send one attempt; the response is open (headers read, body not yet)."""
        if self.transport is not None:
            request = httpx.Request(
                method, url, headers=headers, content=body, extensions={"timeout": self._timeouts}
            )
            response = await self.transport.handle_async_request(request)
            response.request = request
            return response
        assert self.client is not None, "the lifespan sets the client"
        request = self.client.build_request(
            method, url, headers=headers, content=body, timeout=self.timeout
        )
        return await self.client.send(request, stream=True)

    def _refuse(self, replicas: list[ReplicaState], why: Refusal) -> RouterError:
        if why is Refusal.ALL_FULL:
            self.metrics.rejections.labels("all_full").inc()
            waiting = sum(max(r.outstanding - r.max_concurrency, 0) for r in replicas) + 1
            return AllReplicasBusy(
                "every replica is busy (all slots and queues full); retry later",
                retry_after_s=self.rate.retry_after_s(waiting),
            )
        self.metrics.rejections.labels("none_ready").inc()
        states = ", ".join(f"{r.name}: {r.state}" for r in replicas) or "the pool is empty"
        return NoReplicaReady(f"no replica is ready ({states})")

    async def _stream(
        self,
        send: Send,
        response: httpx.Response,
        replica: ReplicaState,
        state: dict[str, bool],
    ) -> None:
        finished = False
        try:
            await send(
                {
                    "type": "http.response.start",
                    "status": response.status_code,
                    "headers": wire.passed_headers(response),
                }
            )
            try:
                async for chunk in response.aiter_raw():
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
            except (httpx.HTTPError, OSError) as exc:
                if isinstance(exc, OSError):
                    raise _ClientGone from exc
                reason = f"stream from replica {replica.name} broke: {wire.describe(exc)}"
                finished = True
                self.outcomes.finish(replica, 502)
                if isinstance(exc, _CONNECT_ERRORS):
                    self.outcomes.eject(replica, reason)
                await send(
                    {
                        "type": "http.response.body",
                        "body": wire.sse_error(reason),
                        "more_body": True,
                    }
                )
            if not finished:
                finished = True
                self.outcomes.finish(replica, response.status_code)
            state["done"] = True
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            if not finished:
                self.outcomes.release(replica)
            await response.aclose()
