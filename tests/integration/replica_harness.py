"""Shared pieces of the replica integration tests: settings, an app with its lifespan running
behind an in-process client, a real uvicorn server in the test's loop, and a fake engine whose
requests block until the test lets them go (so tests count instead of timing)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import httpx
import uvicorn
from fastapi import FastAPI

from common.config import ModelConfig, ReplicaSettings
from replica.app import create_app
from replica.engine import ChatMessage, Delta, Done, Event, GenerationParams
from replica.state import ReplicaState
from tests.support import free_port


def make_settings(source: str = "simulated:decode_ms=0", **kw: Any) -> ReplicaSettings:
    model_keys = {"max_input_tokens", "max_input_chars", "max_new_tokens", "max_body_bytes"}
    model = {k: kw.pop(k) for k in list(kw) if k in model_keys}
    return ReplicaSettings(model=ModelConfig(source=source, **model), **kw)


def state_of(app: FastAPI) -> ReplicaState:
    state: ReplicaState = app.state.replica
    return state


async def wait_until(pred: Callable[[], bool], timeout_s: float = 5.0, what: str = "") -> None:
    """Poll ``pred`` every 10 ms, at most ``timeout_s``."""
    for _ in range(int(timeout_s / 0.01)):
        if pred():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"condition not reached within {timeout_s}s: {what}")


@contextlib.asynccontextmanager
async def client_for(app: FastAPI, *, ready: bool = True) -> AsyncIterator[httpx.AsyncClient]:
    """The app's lifespan running, an httpx client over ASGI; waits for ready unless told not to."""
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(
            transport=transport, base_url="http://replica", timeout=10
        ) as client:
            if ready:
                await wait_until(lambda: state_of(app).status == "ready", what="engine loaded")
            yield client


@contextlib.asynccontextmanager
async def serve(app: FastAPI) -> AsyncIterator[str]:
    """A real uvicorn server for ``app`` on a free loopback port, in this event loop."""
    port = free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning")
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    try:
        await wait_until(lambda: server.started or task.done(), 10, "uvicorn started")
        if task.done():
            task.result()
        await wait_until(lambda: state_of(app).status == "ready", what="engine loaded")
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 15)


async def read_then_leave(
    client: httpx.AsyncClient, payload: dict[str, Any], request_id: str, events: int = 3
) -> None:
    """Stream ``POST /v1/completions``, read ``events`` SSE events, then close the connection
    (as a client that gives up does)."""
    headers = {"X-Request-ID": request_id}
    async with client.stream("POST", "/v1/completions", json=payload, headers=headers) as r:
        assert r.status_code == 200
        lines = r.aiter_lines()
        got = 0
        while got < events:
            if (await anext(lines)).startswith("data: "):
                got += 1


def sse_events(body: str) -> list[Any]:
    """The ``data:`` payloads of an SSE body, JSON-decoded except the final ``[DONE]``."""
    out: list[Any] = []
    for line in body.splitlines():
        if line.startswith("data: "):
            payload = line[len("data: ") :]
            out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


class BlockingEngine:
    """A fake engine: every request waits inside ``stream`` until ``release`` is set.

    It counts starts and how many are inside at once; ``load`` waits on ``load_gate`` if given;
    ``fail_with`` makes the next stream raise after ``fail_after`` deltas.
    """

    model_id = "blocking"
    device = "cpu"

    def __init__(self, load_gate: asyncio.Event | None = None) -> None:
        self.release = asyncio.Event()
        self.load_gate = load_gate
        self.load_error: Exception | None = None
        self.started = 0
        self.active = 0
        self.max_active = 0
        self.closed_early = 0
        self.deltas = 2
        self.fail_with: Exception | None = None
        self.fail_after = 0

    async def load(self) -> None:
        if self.load_gate is not None:
            await self.load_gate.wait()
        if self.load_error is not None:
            raise self.load_error

    def count_tokens(self, text: str) -> int:
        return len(text.split())

    def render_chat(self, messages: Sequence[ChatMessage]) -> str:
        return " ".join(m.content for m in messages)

    def stream(self, prompt: str, params: GenerationParams) -> AsyncIterator[Event]:
        return self._stream(prompt, params)

    async def _stream(self, prompt: str, params: GenerationParams) -> AsyncIterator[Event]:
        self.started += 1
        self.active += 1
        self.max_active = max(self.max_active, self.active)
        finished = False
        fail, self.fail_with = self.fail_with, None
        try:
            await self.release.wait()
            n = min(self.deltas, params.max_tokens)
            for i in range(n):
                if fail is not None and i == self.fail_after:
                    raise fail
                yield Delta(f"w{i} ")
            finished = True
            yield Done("length", self.count_tokens(prompt), n)
        finally:
            self.active -= 1
            if not finished:
                self.closed_early += 1

    def peak_memory_bytes(self) -> int | None:
        return None

    async def close(self) -> None:
        return None


def blocking_app(engine: BlockingEngine | None = None, **kw: Any) -> tuple[FastAPI, BlockingEngine]:
    engine = engine or BlockingEngine()
    app = create_app(make_settings(**kw), engine=engine)
    return app, engine


async def gather_bounded(coros: Sequence[Awaitable[Any]], timeout_s: float = 20) -> list[Any]:
    return list(await asyncio.wait_for(asyncio.gather(*coros), timeout_s))
