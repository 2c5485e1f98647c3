"""TransformersEngine: a Hugging Face causal LM behind the Engine protocol (replica/engine.py).

The model loads once (``await load()``: off the event loop, ``.to(device).eval()``, a short
warm-up). Each request decodes in its own worker thread under ``torch.inference_mode()``, one
token at a time with the KV cache, and hands events to the event loop with
``loop.call_soon_threadsafe``. Closing the stream sets a ``threading.Event``; the thread stops at
the next token and the stream waits for it, so nothing outlives the request.

``peak_memory_bytes()`` is ``torch.cuda.max_memory_allocated`` on CUDA and, on CPU, the process's
peak resident set size (``getrusage``: the whole process, not only tensors).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import os
import resource
import secrets
import threading
import traceback
from collections.abc import AsyncGenerator, Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from replica import models
from replica.engine import ChatMessage, Delta, Done, Event, GenerationParams, StopMatcher
from replica.errors import EngineOutOfMemory, ModelLoadError, NotReady

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

WARMUP_PROMPT = "Hello"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class _Finished:
    """Sentinel the worker sends last (after Done or an exception)."""


_FINISHED = _Finished()


class TransformersEngine:
    """Engine over a transformers model; the constructor does no heavy work."""

    def __init__(
        self,
        source: str,
        device: str = "cpu",
        dtype: str = "auto",
        cache_dir: Path | None = None,
    ) -> None:
        self.source = source
        self.device = device
        self.dtype_name = models.resolve_dtype_name(dtype, device)
        self.cache_dir = cache_dir
        self.model_id = models.model_id_for(source)
        self.eos_token_ids: frozenset[int] = frozenset()
        self.suppress_token_ids: tuple[int, ...] = ()
        self.default_sampling: tuple[float, float] = (0.0, 1.0)  # (temperature, top_p)
        self._model: PreTrainedModel | None = None
        self._tokenizer: PreTrainedTokenizerBase | None = None
        self._tok_lock = threading.Lock()  # fast tokenizers are not safe to share across threads
        self._workers: set[threading.Thread] = set()
        self._forward_kwargs: Callable[[Any], dict[str, Any]] = lambda cache: {}

    # --- loading ---------------------------------------------------------------------------

    async def load(self) -> None:
        if self._model is None:
            await asyncio.to_thread(self._load_blocking)

    def _load_blocking(self) -> None:
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ModelLoadError(
                f"{self.source}: device {self.device} requested but CUDA is absent"
            )
        if self.device != "cpu" and not self.device.startswith("cuda"):
            raise ModelLoadError(
                f"{self.source}: unknown device {self.device!r} (cpu, cuda, cuda:N)"
            )
        cache = self.cache_dir or models.default_cache_dir(os.environ)
        model, tokenizer = models.load(self.source, cache, _DTYPES[self.dtype_name])
        try:
            model = model.to(self.device).eval()  # type: ignore[arg-type]
        except torch.cuda.OutOfMemoryError as exc:
            raise ModelLoadError(f"{self.source}: the weights do not fit on {self.device}") from exc
        self.eos_token_ids = _eos_ids(model, tokenizer)
        gen = getattr(model, "generation_config", None)
        self.suppress_token_ids = tuple(getattr(gen, "suppress_tokens", None) or ())
        self.default_sampling = _default_sampling(gen)
        self._forward_kwargs = _forward_kwargs(model)
        self._model, self._tokenizer = model, tokenizer
        warmup = GenerationParams(max_tokens=2, temperature=0.0)
        for _ in self._generate(WARMUP_PROMPT, warmup, threading.Event()):
            pass

    async def close(self) -> None:
        self._model = None
        self._tokenizer = None
        if self.device.startswith("cuda"):
            torch.cuda.empty_cache()

    @property
    def workers_alive(self) -> int:
        """Worker threads still running (0 once every stream has ended)."""
        return sum(1 for t in list(self._workers) if t.is_alive())

    # --- text ------------------------------------------------------------------------------

    def _tok(self) -> PreTrainedTokenizerBase:
        if self._tokenizer is None:
            raise NotReady("the model is not loaded yet")
        return self._tokenizer

    def encode(self, text: str) -> list[int]:
        tokenizer = self._tok()
        with self._tok_lock:
            return list(tokenizer(text)["input_ids"])

    def _decode(self, ids: Sequence[int]) -> str:
        tokenizer = self._tok()
        with self._tok_lock:
            return str(tokenizer.decode(list(ids), skip_special_tokens=True))

    def count_tokens(self, text: str) -> int:
        return len(self.encode(text))

    def render_chat(self, messages: Sequence[ChatMessage]) -> str:
        tokenizer = self._tok()
        chat = [{"role": m.role, "content": m.content} for m in messages]
        with self._tok_lock:
            text = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        return str(text)

    def peak_memory_bytes(self) -> int | None:
        if self.device.startswith("cuda") and torch.cuda.is_available():
            return int(torch.cuda.max_memory_allocated(self.device))
        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # KiB on Linux

    # --- generation ------------------------------------------------------------------------

    async def stream(self, prompt: str, params: GenerationParams) -> AsyncGenerator[Event, None]:
        self._tok()  # NotReady before load, before any thread starts
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Any] = asyncio.Queue()
        cancel = threading.Event()
        finished = loop.create_future()

        def put(item: Any) -> None:
            with contextlib.suppress(RuntimeError):  # the loop closed under us: nobody listens
                loop.call_soon_threadsafe(queue.put_nowait, item)

        def work() -> None:
            try:
                for event in self._generate(prompt, params, cancel):
                    put(event)
            except BaseException as exc:
                put(exc)
            finally:
                put(_FINISHED)
                with contextlib.suppress(RuntimeError):
                    loop.call_soon_threadsafe(_resolve, finished)

        thread = threading.Thread(target=work, name=f"generate-{self.model_id}", daemon=True)
        self._workers = {t for t in self._workers if t.is_alive()} | {thread}
        thread.start()
        try:
            while True:
                item = await queue.get()
                if item is _FINISHED:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            cancel.set()
            await asyncio.shield(finished)  # the thread has left the decode loop
            thread.join(timeout=1.0)  # ...and is returning: a moment at most

    def _generate(
        self, prompt: str, params: GenerationParams, cancel: threading.Event
    ) -> Iterator[Event]:
        """The decode loop (runs in a worker thread): prefill, then one token at a time."""
        model = self._model
        if model is None:
            raise NotReady("the model is not loaded yet")
        prompt_ids = self.encode(prompt)
        try:
            yield from self._decode_loop(model, prompt_ids, params, cancel)
        except (torch.cuda.OutOfMemoryError, MemoryError) as exc:
            # The failed step's frames (kept by the traceback) hold its KV cache and activations:
            # drop them, so the memory can go back before the next request.
            traceback.clear_frames(exc.__traceback__)
            if self.device.startswith("cuda") and torch.cuda.is_available():
                torch.cuda.empty_cache()
            raise EngineOutOfMemory(
                f"device out of memory while generating ({len(prompt_ids)} prompt tokens); "
                "try a shorter prompt or fewer max_tokens"
            ) from exc

    def _decode_loop(
        self,
        model: PreTrainedModel,
        prompt_ids: list[int],
        params: GenerationParams,
        cancel: threading.Event,
    ) -> Iterator[Event]:
        sample = _sampler(params, self.device, self.default_sampling)
        stops = StopMatcher(params.stop)
        text = _IncrementalText(self._decode)
        suppress = (
            torch.tensor(self.suppress_token_ids, dtype=torch.long, device=self.device)
            if self.suppress_token_ids
            else None
        )
        generated = 0
        finish: str = "length"
        with torch.inference_mode():
            input_ids = torch.tensor([prompt_ids], dtype=torch.long, device=self.device)
            past: Any = None
            while generated < params.max_tokens and not cancel.is_set():
                out = model(input_ids=input_ids, use_cache=True, **self._forward_kwargs(past))
                past = out.get("cache", None) or out.get("past_key_values", None)
                logits = out.logits[0, -1, :].float()
                if suppress is not None:
                    logits[suppress] = float("-inf")
                token = sample(logits)
                if token in self.eos_token_ids:
                    finish = "stop"
                    break
                generated += 1
                piece = stops.feed(text.add(token))
                if piece:
                    yield Delta(piece)
                if stops.stopped:
                    finish = "stop"
                    break
                input_ids = torch.tensor([[token]], dtype=torch.long, device=self.device)
            del past, input_ids
        if cancel.is_set():
            return
        tail = stops.feed(text.flush())
        tail += stops.flush()
        if tail:
            yield Delta(tail)
        yield Done(
            finish_reason="stop" if finish == "stop" else "length",
            prompt_tokens=len(prompt_ids),
            completion_tokens=generated,
        )


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


def _forward_kwargs(model: PreTrainedModel) -> Callable[[Any], dict[str, Any]]:
    """Keyword arguments for one decode step, across transformers versions.

    The KV cache is ``cache`` in transformers 5.x (``past_key_values`` before); only the last
    position's logits are computed, so a long prompt does not materialise prompt x vocab logits.
    """
    names = inspect.signature(model.forward).parameters
    cache_kw = "cache" if "cache" in names else "past_key_values"
    keep = {"logits_to_keep": 1} if "logits_to_keep" in names else {}
    return lambda past: {cache_kw: past, **keep}


def _eos_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> frozenset[int]:
    ids: set[int] = set()
    for holder in (getattr(model, "generation_config", None), model.config):
        value = getattr(holder, "eos_token_id", None)
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list):
            ids.update(v for v in value if isinstance(v, int))
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return frozenset(ids)


def _default_sampling(gen: Any) -> tuple[float, float]:
    """(temperature, top_p) for requests that set none: the model's generation_config, read as
    transformers' generate() reads it (no do_sample: greedy, i.e. temperature 0)."""
    if gen is None or not getattr(gen, "do_sample", False):
        return 0.0, 1.0
    return float(getattr(gen, "temperature", None) or 1.0), float(
        getattr(gen, "top_p", None) or 1.0
    )


def _sampler(
    params: GenerationParams, device: str, defaults: tuple[float, float] = (0.0, 1.0)
) -> Callable[[torch.Tensor], int]:
    """Greedy when temperature == 0; else temperature + top-p with a seeded generator."""
    temperature = defaults[0] if params.temperature is None else params.temperature
    top_p = defaults[1] if params.top_p is None else params.top_p
    if temperature <= 0:
        return lambda logits: int(torch.argmax(logits).item())
    gen = torch.Generator(device=device)
    gen.manual_seed(params.seed if params.seed is not None else secrets.randbits(63))

    def sample(logits: torch.Tensor) -> int:
        probs = torch.softmax(logits / temperature, dim=-1)
        if top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True)
            before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
            drop = before >= top_p  # keep the smallest set reaching top_p...
            drop[0] = False  # ...and always the most likely token (top_p <= 0 means greedy)
            sorted_probs[drop] = 0.0
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        return int(torch.multinomial(probs, 1, generator=gen).item())

    return sample


class _IncrementalText:
    """Decodes token by token without splitting multi-byte characters.

    Keeps a window of recent ids: text is released only when decoding the window no longer ends
    in U+FFFD (an incomplete UTF-8 sequence).
    """

    def __init__(self, decode: Callable[[Sequence[int]], str]) -> None:
        self._decode = decode
        self._ids: list[int] = []
        self._prefix = 0  # start of the window used as left context
        self._read = 0  # ids before this are already emitted

    def add(self, token: int) -> str:
        self._ids.append(token)
        before = self._decode(self._ids[self._prefix : self._read])
        now = self._decode(self._ids[self._prefix :])
        if now.endswith("\ufffd") or len(now) <= len(before):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return now[len(before) :]

    def flush(self) -> str:
        before = self._decode(self._ids[self._prefix : self._read])
        now = self._decode(self._ids[self._prefix :])
        self._prefix = self._read = len(self._ids)
        return now[len(before) :] if len(now) > len(before) else ""
