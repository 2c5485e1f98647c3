"""The replica's routes: OpenAI completions and chat (plain and SSE), /generate, /v1/models,
/health, /metrics, /admin/drain and /admin/undrain.

Order of work for a generation request: read the body (413 past the cap), parse (400/422),
check limits (400), check readiness (503), then admission through the gate (429/503) while
watching for the client going away, then generation under the request deadline (504). A stream
pulls its first event before the response starts, so admission and first-token failures are real
statuses; a failure after that ends the stream with an SSE error event and ``[DONE]``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

from fastapi import APIRouter, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect
from starlette.types import Receive, Scope, Send

from common.config import ReplicaSettings
from common.gpu import GpuProbe
from common.protocol import HealthReport
from replica.engine import ChatMessage, Delta, Done, Engine, Event, GenerationParams
from replica.errors import (
    ClientDisconnected,
    GenerationTimeout,
    InvalidRequest,
    NotReady,
    PayloadTooLarge,
    QueueFull,
    QueueTimeout,
    ReplicaError,
    describe,
)
from replica.gate import Gate, Slot
from replica.metrics import CONTENT_TYPE, ReplicaMetrics
from replica.schemas import ChatRequest, CompletionRequest, GenerateRequest, MessageIn

log = logging.getLogger("replica.api")

T = TypeVar("T")
M = TypeVar("M", bound=BaseModel)
Kind = Literal["chat", "completion", "generate"]


@dataclass
class ReplicaState:
    """Everything the routes share; built by ``replica.app.create_app``."""

    settings: ReplicaSettings
    engine: Engine
    probe: GpuProbe
    gate: Gate
    metrics: ReplicaMetrics
    clock: Callable[[], float]
    started_at: float
    status: Literal["loading", "ready", "failed"] = "loading"
    error: str | None = None
    load_exception: BaseException | None = None

    def health(self) -> HealthReport:
        draining = self.gate.draining
        ready = self.status == "ready" and not draining
        status = self.status if self.status != "ready" else ("draining" if draining else "ready")
        try:
            peak = self.engine.peak_memory_bytes() if self.status == "ready" else None
        except Exception:  # a probe must never break /health
            peak = None
        return HealthReport(
            ready=ready,
            device=self.settings.device,
            model=self.engine.model_id,
            in_flight=self.gate.in_flight,
            queued=self.gate.queued,
            max_concurrency=self.gate.max_concurrency,
            max_queue=self.gate.max_queue,
            memory=self.probe.read(),
            peak_memory_bytes=peak,
            uptime_s=round(self.clock() - self.started_at, 3),
            draining=draining,
            completed=self.gate.completed,
            status=status,
            error=self.error,
        )

    def check_ready(self) -> None:
        if self.status == "loading":
            raise NotReady("the model is still loading; retry shortly")
        if self.status == "failed":
            raise NotReady(f"the model failed to load: {self.error}")


@dataclass
class Job:
    kind: Kind
    prompt: str
    params: GenerationParams
    stream: bool = False
    include_usage: bool = False
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:24])
    created: int = field(default_factory=lambda: int(time.time()))


router = APIRouter()


def _state(request: Request) -> ReplicaState:
    state: ReplicaState = request.app.state.replica
    return state


def _access(request: Request) -> dict[str, Any]:
    """The per-request record the access-log middleware writes out."""
    info: dict[str, Any] = request.scope.setdefault("state", {}).setdefault("access", {})
    return info


# --- reading and checking the request ---------------------------------------------------------


async def _read_json(request: Request, limit: int) -> Any:
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(
            f"request body is {declared} bytes, above the limit of {limit} bytes (max_body_bytes)"
        )
    chunks: list[bytes] = []
    size = 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise PayloadTooLarge(
                    f"request body is over the limit of {limit} bytes (max_body_bytes)"
                )
            chunks.append(chunk)
    except ClientDisconnect as exc:
        raise ClientDisconnected("the client closed the connection while sending") from exc
    try:
        return json.loads(b"".join(chunks))
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidRequest(f"request body is not valid JSON: {exc}") from exc


async def _parse(request: Request, state: ReplicaState, model: type[M]) -> M:
    data = await _read_json(request, state.settings.model.max_body_bytes)
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise RequestValidationError(exc.errors(include_url=False, include_input=False)) from exc


def _params(
    state: ReplicaState,
    max_tokens: int | None,
    default_max: int,
    temperature: float | None,
    top_p: float | None,
    seed: int | None,
    stop: str | list[str] | None,
    param: str = "max_tokens",
) -> GenerationParams:
    limit = state.settings.model.max_new_tokens
    wanted = min(default_max, limit) if max_tokens is None else max_tokens
    if wanted > limit:
        raise InvalidRequest(
            f"{param} is {wanted}, above this replica's limit of {limit} (max_new_tokens)",
            param=param,
        )
    stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
    return GenerationParams(
        max_tokens=wanted,
        temperature=1.0 if temperature is None else temperature,
        top_p=1.0 if top_p is None else top_p,
        seed=seed,
        stop=tuple(s for s in stops if s),
    )


def _check_n(n: int) -> None:
    if n != 1:
        raise InvalidRequest(
            f"n is {n}; this server returns exactly one choice (n must be 1)", param="n"
        )


def _check_chars(state: ReplicaState, text: str, param: str) -> None:
    cap = state.settings.model.input_char_limit
    if len(text) > cap:
        raise InvalidRequest(
            f"{param} is {len(text)} characters, above the limit of {cap} characters "
            f"(max_input_chars)",
            param=param,
        )


def _check_tokens(state: ReplicaState, prompt: str, param: str) -> int:
    limit = state.settings.model.max_input_tokens
    count = state.engine.count_tokens(prompt)
    if count > limit:
        raise InvalidRequest(
            f"{param} is {count} tokens, above the limit of {limit} tokens (max_input_tokens)",
            param=param,
        )
    return count


def _chat_messages(messages: list[MessageIn]) -> list[ChatMessage]:
    if not messages:
        raise InvalidRequest("messages must not be empty", param="messages")
    out = []
    for i, m in enumerate(messages):
        if isinstance(m.content, list):
            parts = []
            for part in m.content:
                if part.type != "text" or part.text is None:
                    raise InvalidRequest(
                        f"messages.{i}.content: only text parts are supported, got {part.type!r}",
                        param=f"messages.{i}.content",
                    )
                parts.append(part.text)
            content = "".join(parts)
        else:
            content = m.content or ""
        out.append(ChatMessage(role="system" if m.role == "developer" else m.role, content=content))
    return out


# --- admission, deadline, disconnects --------------------------------------------------------


async def _client_gone(request: Request) -> None:
    """Returns when the client disconnects (the body has been read, so the server's next
    message is ``http.disconnect``; uvicorn sends it as soon as the socket closes)."""
    for _ in range(1000):  # anything else (never expected) is skipped, a bounded number of times
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
    await asyncio.Event().wait()  # give up watching; cancelled when the work ends


async def _watch(request: Request, task: asyncio.Future[T]) -> T:
    """Await ``task``; if the client disconnects first, cancel it and raise ClientDisconnected."""
    gone = asyncio.ensure_future(_client_gone(request))
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


async def _admit(request: Request, state: ReplicaState) -> Slot:
    task = asyncio.ensure_future(state.gate.acquire())
    try:
        slot = await _watch(request, task)
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
    _access(request)["queue_ms"] = round(slot.queue_wait_s * 1000, 1)
    return slot


class Run:
    """One admitted generation: the engine iterator, its deadline, its slot."""

    def __init__(self, request: Request, state: ReplicaState, job: Job, slot: Slot) -> None:
        self._state = state
        self._slot = slot
        self._info = _access(request)
        self._arrival = float(self._info.get("arrival", state.clock()))
        self._iter = state.engine.stream(job.prompt, job.params)
        self._timeout_s = state.settings.request_timeout_s
        self._deadline = asyncio.get_running_loop().time() + self._timeout_s
        self._first = True
        self._closed = False

    async def next(self) -> Event | None:
        """The next event, or None when the engine is done; GenerationTimeout past the deadline."""
        try:
            async with asyncio.timeout_at(self._deadline) as cm:
                event = await anext(self._iter)
        except StopAsyncIteration:
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


# --- response shapes ------------------------------------------------------------------------


def _usage(done: Done) -> dict[str, int]:
    return {
        "prompt_tokens": done.prompt_tokens,
        "completion_tokens": done.completion_tokens,
        "total_tokens": done.prompt_tokens + done.completion_tokens,
    }


def _body(job: Job, model: str, text: str, done: Done) -> dict[str, Any]:
    if job.kind == "generate":
        return {"result": text, "finish_reason": done.finish_reason, "usage": _usage(done)}
    if job.kind == "chat":
        choice: dict[str, Any] = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "logprobs": None,
            "finish_reason": done.finish_reason,
        }
        head = {"id": "chatcmpl-" + job.id, "object": "chat.completion"}
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": done.finish_reason}
        head = {"id": "cmpl-" + job.id, "object": "text_completion"}
    return {
        **head,
        "created": job.created,
        "model": model,
        "choices": [choice],
        "usage": _usage(done),
    }


def _chunk(job: Job, model: str, text: str | None, finish: str | None) -> dict[str, Any]:
    if job.kind == "chat":
        delta: dict[str, Any] = {} if text is None else {"content": text}
        choice: dict[str, Any] = {
            "index": 0,
            "delta": delta,
            "logprobs": None,
            "finish_reason": finish,
        }
        head = {"id": "chatcmpl-" + job.id, "object": "chat.completion.chunk"}
    else:
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        head = {"id": "cmpl-" + job.id, "object": "text_completion"}
    out = {**head, "created": job.created, "model": model, "choices": [choice]}
    if job.include_usage:
        out["usage"] = None
    return out


def _sse(data: Mapping[str, Any] | str) -> str:
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {payload}\n\n"


async def _events(
    request: Request, state: ReplicaState, job: Job, run: Run, first: Event | None
) -> AsyncIterator[str]:
    model = state.engine.model_id
    info = _access(request)
    if job.kind == "chat":
        role = _chunk(job, model, "", None)
        role["choices"][0]["delta"] = {"role": "assistant", "content": ""}
        yield _sse(role)
    event = first
    try:
        while event is not None:
            if isinstance(event, Delta):
                if event.text:
                    yield _sse(_chunk(job, model, event.text, None))
            else:
                yield _sse(_chunk(job, model, None, event.finish_reason))
                if job.include_usage:
                    usage = {
                        **_chunk(job, model, None, None),
                        "choices": [],
                        "usage": _usage(event),
                    }
                    yield _sse(usage)
                break
            event = await run.next()
    except ReplicaError as exc:
        status, body, _ = describe(exc)
        state.metrics.errors.labels(str(status)).inc()
        info["stream_error"] = status
        yield _sse(body.model_dump())
    except Exception as exc:
        log.error("stream %s failed", info.get("id"), exc_info=exc)
        state.metrics.errors.labels("500").inc()
        info["stream_error"] = 500
        yield _sse(
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
    yield _sse("[DONE]")


# --- running a job -------------------------------------------------------------------------


async def _execute(request: Request, state: ReplicaState, job: Job) -> Response:
    state.check_ready()
    slot = await _admit(request, state)
    run = Run(request, state, job, slot)
    if not job.stream:
        try:
            text, done = await _watch(request, asyncio.ensure_future(run.collect()))
        finally:
            await run.close()
        return JSONResponse(_body(job, state.engine.model_id, text, done))
    try:
        first = await _watch(request, asyncio.ensure_future(run.next()))
    except BaseException:
        await run.close()
        raise
    return GatedStream(
        _events(request, state, job, run, first),
        run.close,
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


@router.post("/v1/completions")
async def completions(request: Request) -> Response:
    state = _state(request)
    body = await _parse(request, state, CompletionRequest)
    _check_n(body.n)
    prompt = body.prompt
    if isinstance(prompt, list):
        if len(prompt) != 1:
            raise InvalidRequest(
                f"prompt is a list of {len(prompt)} strings; send exactly one", param="prompt"
            )
        prompt = prompt[0]
    if not prompt:
        raise InvalidRequest("prompt must not be empty", param="prompt")
    _check_chars(state, prompt, "prompt")
    params = _params(state, body.max_tokens, 16, body.temperature, body.top_p, body.seed, body.stop)
    state.check_ready()
    _check_tokens(state, prompt, "prompt")
    include = bool(body.stream_options and body.stream_options.include_usage)
    job = Job("completion", prompt, params, stream=body.stream, include_usage=include)
    return await _execute(request, state, job)


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    state = _state(request)
    body = await _parse(request, state, ChatRequest)
    _check_n(body.n)
    messages = _chat_messages(body.messages)
    _check_chars(state, "".join(m.content for m in messages), "messages")
    wanted = (
        body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    )
    param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    limit = state.settings.model.max_new_tokens
    params = _params(
        state, wanted, limit, body.temperature, body.top_p, body.seed, body.stop, param
    )
    state.check_ready()
    prompt = state.engine.render_chat(messages)
    _check_tokens(state, prompt, "messages")
    include = bool(body.stream_options and body.stream_options.include_usage)
    job = Job("chat", prompt, params, stream=body.stream, include_usage=include)
    return await _execute(request, state, job)


@router.post("/generate")
async def generate(request: Request) -> Response:
    state = _state(request)
    body = await _parse(request, state, GenerateRequest)
    if not body.text:
        raise InvalidRequest("text must not be empty", param="text")
    _check_chars(state, body.text, "text")
    limit = state.settings.model.max_new_tokens
    params = _params(
        state, body.max_tokens, limit, body.temperature, body.top_p, body.seed, body.stop
    )
    state.check_ready()
    _check_tokens(state, body.text, "text")
    return await _execute(request, state, Job("generate", body.text, params))


@router.get("/v1/models")
async def models(request: Request) -> dict[str, Any]:
    state = _state(request)
    entry = {
        "id": state.engine.model_id,
        "object": "model",
        "created": int(time.time() - (state.clock() - state.started_at)),
        "owned_by": "gpupool",
    }
    return {"object": "list", "data": [entry]}


@router.get("/health")
async def health(request: Request) -> Response:
    report = _state(request).health()
    return JSONResponse(report.model_dump(), status_code=200 if report.ready else 503)


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(_state(request).metrics.render(), media_type=CONTENT_TYPE)


@router.post("/admin/drain")
async def drain(request: Request) -> dict[str, Any]:
    state = _state(request)
    state.gate.drain()
    log.info(
        "draining: new requests get 503; %d in flight, %d queued",
        state.gate.in_flight,
        state.gate.queued,
    )
    return state.health().model_dump()


@router.post("/admin/undrain")
async def undrain(request: Request) -> dict[str, Any]:
    state = _state(request)
    state.gate.undrain()
    log.info("undrained: admitting requests again")
    return state.health().model_dump()
