"""Running one admitted generation: admission while watching for the client leaving, the
request deadline, the slot's release, and the SSE stream.

A stream pulls its first event before the response starts, so admission and first-token
failures are real statuses; a failure after that ends the stream with an SSE error event and
``[DONE]``. A client that leaves while queued never runs; one that leaves while generating stops
the engine at its next token.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.requests import Request
from starlette.types import Receive, Scope, Send

from replica.engine import Delta, Done, Event
from replica.errors import (
    ClientDisconnected,
    GenerationTimeout,
    NotReady,
    QueueFull,
    QueueTimeout,
    ReplicaError,
    describe,
)
from replica.gate import Slot
from replica.responses import Job, chunk, completion_body, sse, usage
from replica.state import ReplicaState, access_record

log = logging.getLogger("replica.api")

T = TypeVar("T")


async def client_gone(request: Request) -> None:
    """Returns when the client disconnects (the body has been read, so the server's next
    message is ``http.disconnect``; uvicorn sends it as soon as the socket closes)."""
    for _ in range(1000):  # anything else (never expected) is skipped, a bounded number of times
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
    await asyncio.Event().wait()  # give up watching; cancelled when the work ends


async def watch(request: Request, task: asyncio.Future[T]) -> T:
    """Await ``task``; if the client disconnects first, cancel it and raise ClientDisconnected."""
    gone = asyncio.ensure_future(client_gone(request))
    try:
        both: set[asyncio.Future[Any]] = {task, gone}
        done, _ = await asyncio.wait(both, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        task.cancel()
        await asyncio.wait({task})
        raise ClientDisconnected("the client closed the connection")
    finally:
        gone.cancel()
        if not task.done():  # we were cancelled: stop the work and let it clean up first
            task.cancel()
            await asyncio.wait({task})


async def admit(request: Request, state: ReplicaState) -> Slot:
    task = asyncio.ensure_future(state.gate.acquire())
    try:
        slot = await watch(request, task)
    except BaseException as exc:
        if task.done() and not task.cancelled() and task.exception() is None:
            task.result().release()  # admitted just as we gave up
        reason = {
            QueueFull: "queue_full",
            QueueTimeout: "queue_timeout",
            NotReady: "draining",
            ClientDisconnected: "client_gone",
        }.get(type(exc))
        if reason:
            state.metrics.rejections.labels(reason).inc()
        raise
    state.metrics.queue_wait.observe(slot.queue_wait_s)
    access_record(request)["queue_ms"] = round(slot.queue_wait_s * 1000, 1)
    return slot


class Run:
    """One admitted generation: the engine iterator, its deadline, its slot."""

    def __init__(self, request: Request, state: ReplicaState, job: Job, slot: Slot) -> None:
        self._state = state
        self._slot = slot
        self._info = access_record(request)
        self._arrival = float(self._info.get("arrival", state.clock()))
        self._iter = state.engine.stream(job.prompt, job.params)
        self._timeout_s = state.settings.request_timeout_s
        self._deadline = asyncio.get_running_loop().time() + self._timeout_s
        self._first = True
        self._closed = False
        self.finished = False  # the engine's Done (or its end) was reached

    async def next(self) -> Event | None:
        """The next event, or None when the engine is done; GenerationTimeout past the deadline."""
        try:
            async with asyncio.timeout_at(self._deadline) as cm:
                event = await anext(self._iter)
        except StopAsyncIteration:
            self.finished = True
            return None
        except TimeoutError as exc:
            if not cm.expired():
                raise
            await self.close()
            raise GenerationTimeout(
                f"generation passed the request deadline of {self._timeout_s:g} s "
                f"(request_timeout_s) and was stopped"
            ) from exc
        if self._first:
            self._first = False
            self._state.metrics.ttft.observe(self._state.clock() - self._arrival)
        if isinstance(event, Done):
            self.finished = True
            self._state.metrics.prompt_tokens.inc(event.prompt_tokens)
            self._state.metrics.completion_tokens.inc(event.completion_tokens)
            self._info["prompt_tokens"] = event.prompt_tokens
            self._info["completion_tokens"] = event.completion_tokens
        return event

    async def collect(self) -> tuple[str, Done]:
        parts = []
        while (event := await self.next()) is not None:
            if isinstance(event, Delta):
                parts.append(event.text)
            else:
                return "".join(parts), event
        raise RuntimeError("engine stream ended without a Done event")

    async def end_stream(self) -> None:
        """``close()`` for a stream; one that ends before the engine finished and without an
        error event was cut by its client, and the access log says so."""
        if not self.finished:
            self._info.setdefault("stream_error", "client_gone")
        await self.close()

    async def close(self) -> None:
        """Stop generation (frees what the engine holds) and give the slot back; idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            aclose = getattr(self._iter, "aclose", None)
            if aclose is not None:
                await aclose()
        finally:
            self._slot.release()


class GatedStream(StreamingResponse):
    """A streaming response that always runs ``on_close`` (slot release), even if never iterated."""

    def __init__(
        self, content: AsyncIterator[str], on_close: Callable[[], Awaitable[None]], **kw: Any
    ) -> None:
        super().__init__(content, **kw)
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._on_close()


async def events(
    request: Request, state: ReplicaState, job: Job, run: Run, first: Event | None
) -> AsyncIterator[str]:
    model = state.engine.model_id
    info = access_record(request)
    if job.kind == "chat":
        role = chunk(job, model, "", None)
        role["choices"][0]["delta"] = {"role": "assistant", "content": ""}
        yield sse(role)
    event = first
    try:
        while event is not None:
            if isinstance(event, Delta):
                if event.text:
                    yield sse(chunk(job, model, event.text, None))
            else:
                yield sse(chunk(job, model, None, event.finish_reason))
                if job.include_usage:
                    final = {**chunk(job, model, None, None), "choices": [], "usage": usage(event)}
                    yield sse(final)
                break
            event = await run.next()
    except ReplicaError as exc:
        status, body, _ = describe(exc)
        state.metrics.errors.labels(str(status)).inc()
        info["stream_error"] = status
        yield sse(body.model_dump())
    except Exception as exc:
        log.error("stream %s failed", info.get("id"), exc_info=exc)
        state.metrics.errors.labels("500").inc()
        info["stream_error"] = 500
        yield sse(
            {
                "error": {
                    "message": f"internal error: {type(exc).__name__}",
                    "type": "server_error",
                    "param": None,
                    "code": "internal_error",
                }
            }
        )
    finally:
        await run.close()
    yield sse("[DONE]")


async def execute(request: Request, state: ReplicaState, job: Job) -> Response:
    """Admit and run ``job``; the route has already checked the request and readiness."""
    slot = await admit(request, state)
    run = Run(request, state, job, slot)
    if not job.stream:
        try:
            text, done = await watch(request, asyncio.ensure_future(run.collect()))
        finally:
            await run.close()
        return JSONResponse(completion_body(job, state.engine.model_id, text, done))
    try:
        first = await watch(request, asyncio.ensure_future(run.next()))
    except BaseException:
        await run.close()
        raise
    return GatedStream(
        events(request, state, job, run, first),
        run.end_stream,
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )
