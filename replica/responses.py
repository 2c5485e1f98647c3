"""OpenAI response shapes: whole answers, stream chunks, SSE framing."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from replica.engine import Done, GenerationParams

Kind = Literal["chat", "completion", "generate"]


@dataclass
class Job:
    kind: Kind
    prompt: str
    params: GenerationParams
    stream: bool = False
    include_usage: bool = False
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:24])
    created: int = field(default_factory=lambda: int(time.time()))


def usage(done: Done) -> dict[str, int]:
    return {
        "prompt_tokens": done.prompt_tokens,
        "completion_tokens": done.completion_tokens,
        "total_tokens": done.prompt_tokens + done.completion_tokens,
    }


def completion_body(job: Job, model: str, text: str, done: Done) -> dict[str, Any]:
    if job.kind == "generate":
        return {"result": text, "finish_reason": done.finish_reason, "usage": usage(done)}
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
        "usage": usage(done),
    }


def chunk(job: Job, model: str, text: str | None, finish: str | None) -> dict[str, Any]:
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


def sse(data: Mapping[str, Any] | str) -> str:
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {payload}\n\n"
