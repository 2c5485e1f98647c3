"""TransformersEngine on builtin:tiny-random (CPU): decoding, stops, streaming, cancel, OOM."""

from __future__ import annotations

import asyncio
import gc
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from replica.engine import ChatMessage, Delta, Done, Event, GenerationParams
from replica.errors import EngineOutOfMemory, ModelLoadError, NotReady
from replica.transformers_engine import TransformersEngine, _default_sampling, _IncrementalText

PROMPT = "Hello! How are you today?"


@pytest.fixture(scope="module")
def engine() -> Iterator[TransformersEngine]:
    eng = TransformersEngine("builtin:tiny-random", device="cpu")
    asyncio.run(eng.load())
    yield eng
    asyncio.run(eng.close())


async def collect(engine: TransformersEngine, prompt: str, **kw: Any) -> list[Event]:
    return [event async for event in engine.stream(prompt, GenerationParams(**kw))]


def text_of(events: list[Event]) -> str:
    return "".join(e.text for e in events if isinstance(e, Delta))


def done_of(events: list[Event]) -> Done:
    assert isinstance(events[-1], Done)
    assert sum(isinstance(e, Done) for e in events) == 1
    return events[-1]


async def test_greedy_is_deterministic_and_max_tokens_means_length(
    engine: TransformersEngine,
) -> None:
    first = await collect(engine, PROMPT, max_tokens=12, temperature=0.0)
    second = await collect(engine, PROMPT, max_tokens=12, temperature=0.0)
    assert text_of(first) == text_of(second) != ""
    done = done_of(first)
    assert done.finish_reason == "length"
    assert done.completion_tokens == 12
    assert done.prompt_tokens == engine.count_tokens(PROMPT)


async def test_same_seed_same_sample(engine: TransformersEngine) -> None:
    def sample(seed: int) -> Any:
        return collect(engine, PROMPT, max_tokens=24, temperature=1.0, top_p=0.9, seed=seed)

    a, b, c = await sample(7), await sample(7), await sample(8)
    assert text_of(a) == text_of(b)
    assert text_of(a) != text_of(c)


async def test_unset_sampling_follows_the_models_generation_config(
    engine: TransformersEngine,
) -> None:
    # tiny-random's generation_config does not sample, so a request without temperature/top_p
    # is greedy, as transformers' generate() would be.
    assert engine.default_sampling == (0.0, 1.0)
    greedy = text_of(await collect(engine, PROMPT, max_tokens=16, temperature=0.0))
    assert text_of(await collect(engine, PROMPT, max_tokens=16)) == greedy
    from transformers import GenerationConfig

    sampling = GenerationConfig(do_sample=True, temperature=0.2, top_p=0.9)
    assert _default_sampling(sampling) == (0.2, 0.9)
    assert _default_sampling(GenerationConfig()) == (0.0, 1.0)
    assert _default_sampling(None) == (0.0, 1.0)


async def test_tiny_top_p_is_greedy(engine: TransformersEngine) -> None:
    greedy = await collect(engine, PROMPT, max_tokens=10, temperature=0.0)
    nucleus = await collect(engine, PROMPT, max_tokens=10, temperature=1.0, top_p=1e-9, seed=1)
    assert text_of(nucleus) == text_of(greedy)


async def test_stop_sequence_cuts_the_text_and_is_never_emitted(
    engine: TransformersEngine,
) -> None:
    full = text_of(await collect(engine, PROMPT, max_tokens=30, temperature=0.0))
    stop = full[8:11]
    cut = full.find(stop)
    events = await collect(engine, PROMPT, max_tokens=30, temperature=0.0, stop=(stop, "\x00"))
    assert text_of(events) == full[:cut]
    assert all(stop not in e.text for e in events if isinstance(e, Delta))
    done = done_of(events)
    assert done.finish_reason == "stop"
    assert done.completion_tokens < 30


async def test_eos_ends_with_finish_stop(engine: TransformersEngine) -> None:
    """tiny-random never emits its EOS, so declare the greedy path's 4th token an EOS."""
    model = engine._model
    assert model is not None
    ids = engine.encode(PROMPT)
    with torch.inference_mode():
        for _ in range(4):
            logits = model(input_ids=torch.tensor([ids])).logits[0, -1]
            logits[list(engine.suppress_token_ids)] = float("-inf")
            ids.append(int(logits.argmax()))
    saved = engine.eos_token_ids
    engine.eos_token_ids = frozenset({ids[-1]})
    try:
        done = done_of(await collect(engine, PROMPT, max_tokens=20, temperature=0.0))
    finally:
        engine.eos_token_ids = saved
    assert done.finish_reason == "stop"
    assert done.completion_tokens <= 3


async def test_streaming_yields_several_deltas_before_done(engine: TransformersEngine) -> None:
    events = await collect(engine, PROMPT, max_tokens=16, temperature=0.0)
    deltas = [e for e in events[:-1] if isinstance(e, Delta) and e.text]
    assert len(deltas) >= 3
    assert all(isinstance(e, Delta) for e in events[:-1])
    done_of(events)


async def test_aclose_mid_stream_stops_the_worker_thread(engine: TransformersEngine) -> None:
    stream = engine.stream(PROMPT, GenerationParams(max_tokens=1_000_000, temperature=0.0))
    first = [await anext(stream) for _ in range(3)]
    assert all(isinstance(e, Delta) for e in first)
    assert engine.workers_alive == 1
    await stream.aclose()
    assert engine.workers_alive == 0


async def test_cancelled_consumer_stops_the_worker_thread(engine: TransformersEngine) -> None:
    seen = asyncio.Event()

    async def consume() -> None:
        params = GenerationParams(max_tokens=1_000_000, temperature=0.0)
        async for _ in engine.stream(PROMPT, params):
            seen.set()

    task = asyncio.create_task(consume())
    await asyncio.wait_for(seen.wait(), timeout=30)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    for _ in range(100):  # bounded: up to ~5 s for the thread to notice
        if engine.workers_alive == 0:
            break
        await asyncio.sleep(0.05)
    assert engine.workers_alive == 0


async def test_concurrent_streams_each_get_their_own_answer(engine: TransformersEngine) -> None:
    results = await asyncio.gather(
        *(collect(engine, f"{PROMPT} {i}", max_tokens=8 + i, temperature=0.0) for i in range(4))
    )
    assert [done_of(r).completion_tokens for r in results] == [8, 9, 10, 11]
    assert engine.workers_alive == 0


@pytest.mark.parametrize(
    "error", [torch.cuda.OutOfMemoryError("CUDA out of memory"), MemoryError()]
)
async def test_injected_oom_fails_one_request_and_the_next_works(
    engine: TransformersEngine, monkeypatch: pytest.MonkeyPatch, error: BaseException
) -> None:
    model = engine._model
    assert model is not None
    real_forward = model.forward
    calls = {"n": 0}

    def forward_failing_once(*args: Any, **kwargs: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 1:
            raise error
        return real_forward(*args, **kwargs)

    monkeypatch.setattr(model, "forward", forward_failing_once)
    with pytest.raises(EngineOutOfMemory) as info:
        await collect(engine, PROMPT, max_tokens=5, temperature=0.0)
    assert "out of memory" in info.value.message
    assert f"({engine.count_tokens(PROMPT)} prompt tokens)" in info.value.message
    assert info.value.__cause__ is error
    done = done_of(await collect(engine, PROMPT, max_tokens=5, temperature=0.0))
    assert done.completion_tokens == 5
    assert engine.workers_alive == 0


async def test_oom_lets_go_of_the_failed_steps_tensors(
    engine: TransformersEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = engine._model
    assert model is not None
    real_forward = model.forward
    held: list[weakref.ref[torch.Tensor]] = []

    def forward_failing_on_the_third_step(*args: Any, **kwargs: Any) -> Any:
        if len(held) == 2:
            activations = torch.ones(1024)  # what a real step holds when it runs out
            held.append(weakref.ref(activations))
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (test)")
        out = real_forward(*args, **kwargs)
        held.append(weakref.ref(out.logits))
        return out

    monkeypatch.setattr(model, "forward", forward_failing_on_the_third_step)
    with pytest.raises(EngineOutOfMemory) as info:
        await collect(engine, PROMPT, max_tokens=5, temperature=0.0)
    gc.collect()
    # The error (and its cause) is still held here, yet no tensor of the request survives.
    assert isinstance(info.value.__cause__, torch.cuda.OutOfMemoryError)
    assert len(held) == 3
    assert [ref() is None for ref in held] == [True, True, True]


def test_chat_template_renders_with_generation_prompt(engine: TransformersEngine) -> None:
    text = engine.render_chat(
        [ChatMessage("system", "Be brief."), ChatMessage("user", "What is 2+2?")]
    )
    assert text.index("Be brief.") < text.index("What is 2+2?")
    assert text.endswith("<|im_start|>assistant\n")


def test_incremental_decoding_never_splits_a_character(engine: TransformersEngine) -> None:
    original = "naïve café in 東京 😀!"
    ids = engine.encode(original)
    text = _IncrementalText(engine._decode)
    pieces = [text.add(token) for token in ids]
    pieces.append(text.flush())
    assert "".join(pieces) == original
    assert not any("\ufffd" in p for p in pieces)
    assert "" in pieces[:-1]  # some token was a partial character and was held back


def test_identity_and_memory(engine: TransformersEngine) -> None:
    assert engine.model_id == "tiny-random"
    assert engine.device == "cpu"
    peak = engine.peak_memory_bytes()
    assert peak is not None and peak > 0


async def test_not_ready_before_load() -> None:
    eng = TransformersEngine("builtin:tiny-random")
    with pytest.raises(NotReady):
        eng.count_tokens("hi")
    with pytest.raises(NotReady):
        await collect(eng, "hi", max_tokens=2)


async def test_bad_source_fails_load_naming_it(tmp_path: Path) -> None:
    source = str(tmp_path / "no-such-model")
    eng = TransformersEngine(source, cache_dir=tmp_path)
    with pytest.raises(ModelLoadError, match="no-such-model"):
        await eng.load()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA message")
async def test_cuda_without_cuda_is_a_clear_load_error() -> None:
    eng = TransformersEngine("builtin:tiny-random", device="cuda:0")
    assert eng.dtype_name == "bfloat16"
    with pytest.raises(ModelLoadError, match="CUDA"):
        await eng.load()
