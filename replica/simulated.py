"""SimulatedEngine: the timing and memory model of a GPU replica, without torch.

Chosen by ``--model simulated[:key=value,...]``, never silently. It lets the router, failover and
the load tools run against many replicas on one small machine. Options (all optional):

- ``fixed_ms`` per request (default 0), ``prefill_ms`` per prompt token (0.05), ``decode_ms``
  per output token step (10);
- ``knee``: concurrent requests inside the engine beyond which every step slows proportionally,
  step = decode_ms * max(1, active / knee) (default 1000);
- ``weights_mb`` (500), ``kv_kb_per_token`` (64), ``total_mb`` (16384): memory in use is the
  weights plus the KV bytes of every token the in-flight requests hold; a request that would
  push it past ``total_mb`` fails with ``EngineOutOfMemory`` (the others go on);
- ``load_s``: start-up delay (0).

Text is deterministic: words drawn from a seeded generator keyed by the prompt (and ``seed``).
Tokens are whitespace-separated words. Generation always runs to ``max_tokens`` unless a stop
sequence ends it.
"""

from __future__ import annotations

import asyncio
import hashlib
import random
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from dataclasses import dataclass, fields

from common.gpu import FakeGpuProbe
from replica.engine import ChatMessage, Delta, Done, Event, GenerationParams, StopMatcher
from replica.errors import EngineOutOfMemory, ModelLoadError

Sleep = Callable[[float], Awaitable[None]]

MB = 1024 * 1024
KB = 1024

_WORDS = [
    "the",
    "a",
    "river",
    "stone",
    "light",
    "green",
    "quiet",
    "model",
    "token",
    "stream",
    "small",
    "large",
    "fast",
    "slow",
    "north",
    "south",
    "garden",
    "window",
    "paper",
    "engine",
    "signal",
    "cloud",
    "bridge",
    "morning",
    "evening",
    "simple",
    "careful",
    "bright",
    "question",
    "answer",
    "number",
    "letter",
    "music",
    "water",
    "forest",
    "city",
    "road",
    "field",
    "apple",
    "orange",
    "table",
    "chair",
    "story",
    "reason",
    "moment",
    "system",
    "memory",
    "device",
    "queue",
    "router",
    "replica",
    "batch",
]


@dataclass(frozen=True)
class SimulatedOptions:
    fixed_ms: float = 0.0
    prefill_ms: float = 0.05
    decode_ms: float = 10.0
    knee: float = 1000.0
    weights_mb: float = 500.0
    kv_kb_per_token: float = 64.0
    total_mb: float = 16384.0
    load_s: float = 0.0

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if value < 0:
                raise ValueError(f"{f.name} must be >= 0, got {value}")
        if self.knee <= 0:
            raise ValueError(f"knee must be > 0, got {self.knee}")
        if self.total_mb <= 0:
            raise ValueError(f"total_mb must be > 0, got {self.total_mb}")
        if self.weights_mb > self.total_mb:
            raise ValueError(
                f"weights_mb ({self.weights_mb}) does not fit in total_mb ({self.total_mb})"
            )


def is_simulated(source: str) -> bool:
    return source == "simulated" or source.startswith("simulated:")


def parse_simulated(source: str) -> SimulatedOptions:
    """``simulated`` or ``simulated:k=v,k=v`` -> options; ModelLoadError names what is wrong."""
    if not is_simulated(source):
        raise ModelLoadError(f"model source {source!r} is not simulated[:key=value,...]")
    rest = source[len("simulated") :].removeprefix(":")
    known = {f.name for f in fields(SimulatedOptions)}
    values: dict[str, float] = {}
    for item in (part.strip() for part in rest.split(",")):
        if not item:
            continue
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep:
            raise ModelLoadError(f"model source {source!r}: option {item!r} is not key=value")
        if key not in known:
            raise ModelLoadError(
                f"model source {source!r}: unknown option {key!r} "
                f"(known: {', '.join(sorted(known))})"
            )
        try:
            values[key] = float(raw)
        except ValueError as exc:
            raise ModelLoadError(
                f"model source {source!r}: {key} must be a number, got {raw.strip()!r}"
            ) from exc
    try:
        return SimulatedOptions(**values)
    except ValueError as exc:
        raise ModelLoadError(f"model source {source!r}: {exc}") from exc


class SimulatedEngine:
    """Implements ``replica.engine.Engine`` with sleeps and a memory ledger."""

    model_id = "simulated"

    def __init__(
        self,
        options: SimulatedOptions | None = None,
        *,
        device: str = "cpu",
        sleep: Sleep | None = None,
    ) -> None:
        self.options = options or SimulatedOptions()
        self.device = device
        self._sleep: Sleep = sleep or asyncio.sleep
        self.probe = FakeGpuProbe(total_bytes=int(self.options.total_mb * MB))
        self._weights = int(self.options.weights_mb * MB)
        self._kv_per_token = int(self.options.kv_kb_per_token * KB)
        self._kv_bytes = 0
        self._loaded = False
        self._peak = 0
        self.active = 0  # requests inside stream() right now
        self.max_active = 0  # the most seen at once (tests count with it)
        self.started = 0  # streams that began generating

    @classmethod
    def from_source(cls, source: str, *, device: str = "cpu") -> SimulatedEngine:
        return cls(parse_simulated(source), device=device)

    async def load(self) -> None:
        if self.options.load_s:
            await self._sleep(self.options.load_s)
        self._loaded = True
        self._update_probe()

    async def close(self) -> None:
        self._loaded = False
        self._update_probe()

    def count_tokens(self, text: str) -> int:
        return len(text.split())

    def render_chat(self, messages: Sequence[ChatMessage]) -> str:
        lines = [f"{m.role}: {m.content}" for m in messages]
        return "\n".join([*lines, "assistant:"])

    def peak_memory_bytes(self) -> int | None:
        return self._peak

    @property
    def used_bytes(self) -> int:
        return (self._weights if self._loaded else 0) + self._kv_bytes

    def _update_probe(self) -> None:
        self.probe.used_bytes = self.used_bytes
        self._peak = max(self._peak, self.used_bytes)

    def _reserve(self, tokens: int) -> None:
        extra = tokens * self._kv_per_token
        if self.used_bytes + extra > self.probe.total_bytes:
            free_mb = (self.probe.total_bytes - self.used_bytes) / MB
            raise EngineOutOfMemory(
                f"out of device memory: {tokens} more tokens need {extra / MB:.1f} MiB of KV "
                f"cache, {free_mb:.1f} MiB free of {self.options.total_mb:g} MiB (simulated)"
            )
        self._kv_bytes += extra
        self._update_probe()

    def _step_s(self) -> float:
        return self.options.decode_ms * max(1.0, self.active / self.options.knee) / 1000.0

    def stream(self, prompt: str, params: GenerationParams) -> AsyncGenerator[Event, None]:
        return self._generate(prompt, params)

    async def _generate(self, prompt: str, params: GenerationParams) -> AsyncGenerator[Event, None]:
        prompt_tokens = self.count_tokens(prompt)
        digest = hashlib.blake2b(f"{params.seed}|{prompt}".encode(), digest_size=8).digest()
        rng = random.Random(int.from_bytes(digest, "big"))
        matcher = StopMatcher(params.stop)
        held = 0
        self.active += 1
        self.max_active = max(self.max_active, self.active)
        self.started += 1
        try:
            self._reserve(prompt_tokens)
            held += prompt_tokens
            opts = self.options
            await self._sleep((opts.fixed_ms + opts.prefill_ms * prompt_tokens) / 1000.0)
            completion = 0
            while completion < params.max_tokens:
                self._reserve(1)
                held += 1
                await self._sleep(self._step_s())
                word = rng.choice(_WORDS)
                completion += 1
                text = matcher.feed(word if completion == 1 else " " + word)
                if text:
                    yield Delta(text)
                if matcher.stopped:
                    yield Done("stop", prompt_tokens, completion)
                    return
            tail = matcher.flush()
            if tail:
                yield Delta(tail)
            yield Done("length", prompt_tokens, completion)
        finally:
            self.active -= 1
            self._kv_bytes -= held * self._kv_per_token
            self._update_probe()
