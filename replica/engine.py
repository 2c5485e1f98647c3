"""The Engine protocol: what the replica's HTTP layer needs from a model runtime.

This module never imports torch, so the gate, the API and the simulated engine stay light.
``TransformersEngine`` (the only torch/transformers user besides ``models.py``) lives in
``replica/transformers_engine.py``; ``SimulatedEngine`` in ``replica/simulated.py``.

Contract:
- ``load()`` is awaited once by the app's lifespan; it loads the model, runs a short warm-up, and
  returns only when the engine can serve. Blocking work runs off the event loop.
- ``stream(prompt, params)`` is an async iterator of ``Delta`` events ending with exactly one
  ``Done``. It allocates nothing on the device until iterated (the gate admits a request first).
  Closing the iterator early (``aclose()``: client gone, deadline passed) stops generation at the
  next token and frees everything it held.
- Device out-of-memory during a request raises ``replica.errors.EngineOutOfMemory`` (chained from
  the torch error) after freeing cached memory; the engine stays usable.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

FinishReason = Literal["stop", "length"]


@dataclass(frozen=True)
class GenerationParams:
    max_tokens: int
    # None: the model's own default (its generation_config, as transformers' generate() uses it).
    temperature: float | None = None  # 0 means greedy
    top_p: float | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()


@dataclass(frozen=True)
class Delta:
    """Newly generated text (may be empty while a multi-byte char or a stop prefix is held)."""

    text: str


@dataclass(frozen=True)
class Done:
    finish_reason: FinishReason
    prompt_tokens: int
    completion_tokens: int


Event = Delta | Done


@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str


class Engine(Protocol):
    model_id: str  # the name shown in /v1/models and /health
    device: str  # "cpu", "cuda", "cuda:0"

    async def load(self) -> None: ...

    def count_tokens(self, text: str) -> int: ...

    def render_chat(self, messages: Sequence[ChatMessage]) -> str:
        """The prompt text for a chat (the model's chat template, generation prompt added)."""
        ...

    def stream(self, prompt: str, params: GenerationParams) -> AsyncIterator[Event]: ...

    def peak_memory_bytes(self) -> int | None:
        """Peak device memory this process allocated (torch's allocator), None if unknown."""
        ...

    async def close(self) -> None: ...


@dataclass
class StopMatcher:
    """Holds back text that might be the start of a stop sequence.

    Feed it decoded text piece by piece; it returns what is safe to emit and tells when a stop
    sequence was completed (the stop text itself is never emitted, as in the OpenAI API).
    """

    stops: Sequence[str]
    _pending: str = field(default="", init=False)
    stopped: bool = field(default=False, init=False)

    def feed(self, text: str) -> str:
        if self.stopped:
            return ""
        buf = self._pending + text
        if not self.stops:
            self._pending = ""
            return buf
        cut = min((i for i in (buf.find(s) for s in self.stops if s) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            self._pending = ""
            return buf[:cut]
        # Keep the longest suffix of buf that is a prefix of some stop sequence.
        hold = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(buf)), 0, -1):
                if buf.endswith(s[:k]):
                    hold = max(hold, k)
                    break
        self._pending = buf[len(buf) - hold :] if hold else ""
        return buf[: len(buf) - hold]

    def flush(self) -> str:
        """At the end of generation: whatever was held back is real text."""
        out, self._pending = ("" if self.stopped else self._pending), ""
        return out
