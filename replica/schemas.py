"""OpenAI request shapes the replica accepts (unknown fields are ignored, as OpenAI does).

Numbers and flags are strict: ``"max_tokens": true`` or ``"stream": "yes"`` is a 422, not 1 or
True (an int is still a valid float).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


# The range a torch generator takes (a seed outside it would fail inside the engine).
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1


class StreamOptions(_Lenient):
    include_usage: bool = Field(False, strict=True)


class Sampling(_Lenient):
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1, strict=True)
    temperature: float | None = Field(None, ge=0, le=2, strict=True)
    top_p: float | None = Field(None, gt=0, le=1, strict=True)
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX, strict=True)
    stop: str | list[str] | None = None
    stream: bool = Field(False, strict=True)
    stream_options: StreamOptions | None = None
    n: int = Field(1, strict=True)
    user: str | None = None


class CompletionRequest(Sampling):
    prompt: str | list[str]


class ContentPart(_Lenient):
    type: str
    text: str | None = None


class MessageIn(_Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None


class ChatRequest(Sampling):
    messages: list[MessageIn]
    max_completion_tokens: int | None = Field(None, ge=1, strict=True)


class GenerateRequest(_Lenient):
    text: str
    max_tokens: int | None = Field(None, ge=1, strict=True)
    temperature: float | None = Field(None, ge=0, le=2, strict=True)
    top_p: float | None = Field(None, gt=0, le=1, strict=True)
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX, strict=True)
    stop: str | list[str] | None = None
