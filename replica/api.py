"""The replica's routes: OpenAI completions and chat (plain and SSE), /generate, /v1/models,
/health, /metrics, /admin/drain and /admin/undrain.

Order of work for a generation request: read the body (413 past the cap), parse (400/422),
check limits (400), check readiness (503), then ``execution.execute``: admission through the gate
(429/503) while watching for the client going away, then generation under the request deadline
(504).
"""

from __future__ import annotations

import json
import logging
import time
import zlib
from typing import Any, TypeVar

from fastapi import APIRouter, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect

from replica.engine import ChatMessage, GenerationParams
from replica.errors import ClientDisconnected, InvalidRequest, PayloadTooLarge, ReplicaError
from replica.execution import execute
from replica.metrics import CONTENT_TYPE
from replica.responses import Job, Kind
from replica.schemas import (
    ChatRequest,
    CompletionRequest,
    GenerateRequest,
    MessageIn,
    Sampling,
)
from replica.state import ReplicaState, state_of

log = logging.getLogger("replica.api")

M = TypeVar("M", bound=BaseModel)

router = APIRouter()


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
                    f"request body is at least {size} bytes, above the limit of {limit} bytes "
                    "(max_body_bytes)"
                )
            chunks.append(chunk)
    except ClientDisconnect as exc:
        raise ClientDisconnected("the client closed the connection while sending") from exc
    body = _decode(b"".join(chunks), request.headers.get("content-encoding", ""), limit)
    try:
        return json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidRequest(f"request body is not valid JSON: {exc}") from exc


_WBITS = {"gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}


def _decode(raw: bytes, encoding: str, limit: int) -> bytes:
    """Undo a gzip/deflate Content-Encoding (the router passes it on); the cap holds after."""
    encoding = encoding.strip().lower()
    if encoding in ("", "identity"):
        return raw
    if encoding not in _WBITS:
        raise InvalidRequest(
            f"Content-Encoding {encoding!r} is not supported (gzip, deflate or none)"
        )
    inflater = zlib.decompressobj(_WBITS[encoding])
    try:
        body = inflater.decompress(raw, limit + 1)
    except zlib.error as exc:
        raise InvalidRequest(f"request body is not valid {encoding}: {exc}") from exc
    if len(body) > limit:
        raise PayloadTooLarge(
            f"request body is more than {limit} bytes once decompressed ({encoding}), above "
            f"the limit of {limit} bytes (max_body_bytes)"
        )
    return body


async def _parse(request: Request, state: ReplicaState, model: type[M]) -> M:
    data = await _read_json(request, state.settings.model.max_body_bytes)
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise RequestValidationError(exc.errors(include_url=False)) from exc


def _params(
    state: ReplicaState,
    body: Sampling | GenerateRequest,
    max_tokens: int | None,
    default_max: int | None = None,
    param: str = "max_tokens",
) -> GenerationParams:
    """The body's sampling parameters; an unset ``max_tokens`` is ``default_max`` (None: the
    replica's limit), never above the limit."""
    limit = state.settings.model.max_new_tokens
    if max_tokens is None:
        wanted = limit if default_max is None else min(default_max, limit)
    else:
        wanted = max_tokens
    if wanted > limit:
        raise InvalidRequest(
            f"{param} is {wanted}, above this replica's limit of {limit} (max_new_tokens)",
            param=param,
        )
    stop = body.stop
    stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
    return GenerationParams(
        max_tokens=wanted,
        temperature=body.temperature,
        top_p=body.top_p,
        seed=body.seed,
        stop=tuple(s for s in stops if s),
    )


def _check_n(n: int) -> None:
    if n != 1:
        raise InvalidRequest(
            f"n is {n}; this server returns exactly one choice (n must be 1)", param="n"
        )


def _check_text(state: ReplicaState, text: str, param: str) -> None:
    """The character cap (before any tokenizing), then that the text is encodable Unicode."""
    cap = state.settings.model.input_char_limit
    if len(text) > cap:
        raise InvalidRequest(
            f"{param} is {len(text)} characters, above the limit of {cap} characters "
            f"(max_input_chars)",
            param=param,
        )
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:  # a lone UTF-16 surrogate such as "\ud800"
        raise InvalidRequest(
            f"{param} is not valid Unicode: unpaired surrogate {text[exc.start]!r} "
            f"at character {exc.start}",
            param=param,
        ) from exc


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
                if part.type != "text":
                    raise InvalidRequest(
                        f"messages.{i}.content: only text parts are supported, got {part.type!r}",
                        param=f"messages.{i}.content",
                    )
                if part.text is None:
                    raise InvalidRequest(
                        f"messages.{i}.content: a text part needs a 'text' string",
                        param=f"messages.{i}.content",
                    )
                parts.append(part.text)
            content = "".join(parts)
        else:
            content = m.content or ""
        out.append(ChatMessage(role="system" if m.role == "developer" else m.role, content=content))
    return out


def _openai_job(kind: Kind, prompt: str, params: GenerationParams, body: Sampling) -> Job:
    include = bool(body.stream_options and body.stream_options.include_usage)
    return Job(kind, prompt, params, stream=body.stream, include_usage=include)


@router.post("/v1/completions")
async def completions(request: Request) -> Response:
    state = state_of(request)
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
    _check_text(state, prompt, "prompt")
    params = _params(state, body, body.max_tokens, 16)
    state.check_ready()
    _check_tokens(state, prompt, "prompt")
    return await execute(request, state, _openai_job("completion", prompt, params, body))


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    state = state_of(request)
    body = await _parse(request, state, ChatRequest)
    _check_n(body.n)
    messages = _chat_messages(body.messages)
    _check_text(state, "".join(m.content for m in messages), "messages")
    wanted = (
        body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    )
    param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    params = _params(state, body, wanted, param=param)
    state.check_ready()
    try:
        prompt = state.engine.render_chat(messages)
    except ReplicaError:
        raise
    except Exception as exc:  # the model's chat template refused these messages
        raise InvalidRequest(
            f"messages: the model's chat template cannot render them: {exc}", param="messages"
        ) from exc
    _check_text(state, prompt, "messages")  # the template's own text counts before tokenizing
    _check_tokens(state, prompt, "messages")
    return await execute(request, state, _openai_job("chat", prompt, params, body))


@router.post("/generate")
async def generate(request: Request) -> Response:
    state = state_of(request)
    body = await _parse(request, state, GenerateRequest)
    if not body.text:
        raise InvalidRequest("text must not be empty", param="text")
    _check_text(state, body.text, "text")
    params = _params(state, body, body.max_tokens)
    state.check_ready()
    _check_tokens(state, body.text, "text")
    return await execute(request, state, Job("generate", body.text, params))


@router.get("/v1/models")
async def models(request: Request) -> dict[str, Any]:
    state = state_of(request)
    entry = {
        "id": state.engine.model_id,
        "object": "model",
        "created": int(time.time() - (state.clock() - state.started_at)),
        "owned_by": "gpupool",
    }
    return {"object": "list", "data": [entry]}


@router.get("/health")
async def health(request: Request) -> Response:
    report = state_of(request).health()
    return JSONResponse(report.model_dump(), status_code=200 if report.ready else 503)


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(state_of(request).metrics.render(), media_type=CONTENT_TYPE)


@router.post("/admin/drain")
async def drain(request: Request) -> dict[str, Any]:
    state = state_of(request)
    state.gate.drain()
    log.info(
        "draining: new requests get 503; %d in flight, %d queued",
        state.gate.in_flight,
        state.gate.queued,
    )
    return state.health().model_dump()


@router.post("/admin/undrain")
async def undrain(request: Request) -> dict[str, Any]:
    state = state_of(request)
    state.gate.undrain()
    log.info("undrained: admitting requests again")
    return state.health().model_dump()
