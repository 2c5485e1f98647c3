"""OpenAI request shapes the replica accepts (unknown fields are ignored, as OpenAI does)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


# The range a torch generator takes (a seed outside it would fail inside the engine).
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1


class StreamOptions(_Lenient):
    include_usage: bool = False


class Sampling(_Lenient):
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
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
    max_completion_tokens: int | None = Field(None, ge=1)


class GenerateRequest(_Lenient):
    text: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    stop: str | list[str] | None = None
