"""SimulatedEngine: option parsing, deterministic text, limits, timing model, memory model."""

from __future__ import annotations

import pytest

from replica.engine import ChatMessage, Delta, Done, Event, GenerationParams
from replica.errors import EngineOutOfMemory, ModelLoadError
from replica.simulated import MB, SimulatedEngine, SimulatedOptions, parse_simulated


class RecordingSleep:
    """The engine's sleep seam: records each requested delay, returns at once."""

    def __init__(self) -> None:
        self.delays: list[float] = []

    async def __call__(self, seconds: float) -> None:
        self.delays.append(seconds)


async def run(engine: SimulatedEngine, prompt: str, **kw: object) -> tuple[str, Done]:
    params = GenerationParams(**{"max_tokens": 8, **kw})  # type: ignore[arg-type]
    text = ""
    async for event in engine.stream(prompt, params):
        if isinstance(event, Delta):
            text += event.text
        else:
            return text, event
    raise AssertionError("no Done event")


async def loaded(options: SimulatedOptions | None = None) -> tuple[SimulatedEngine, RecordingSleep]:
    sleep = RecordingSleep()
    engine = SimulatedEngine(options, sleep=sleep)
    await engine.load()
    return engine, sleep


# --- parsing ------------------------------------------------------------------------------


def test_parse_defaults_and_options() -> None:
    assert parse_simulated("simulated") == SimulatedOptions()
    opts = parse_simulated("simulated:fixed_ms=50,decode_ms=0, knee=4,total_mb=2048")
    assert (opts.fixed_ms, opts.decode_ms, opts.knee, opts.total_mb) == (50, 0, 4, 2048)
    assert opts.prefill_ms == SimulatedOptions().prefill_ms


@pytest.mark.parametrize(
    ("source", "needle"),
    [
        ("simulated:decode=5", "unknown option 'decode'"),
        ("simulated:decode_ms=fast", "decode_ms must be a number, got 'fast'"),
        ("simulated:decode_ms", "is not key=value"),
        ("simulated:fixed_ms=-1", "fixed_ms must be >= 0"),
        ("simulated:knee=0", "knee must be > 0"),
        ("simulated:weights_mb=4000,total_mb=1000", "does not fit"),
        ("simulatedx", "is not simulated"),
    ],
)
def test_parse_errors_name_the_problem(source: str, needle: str) -> None:
    with pytest.raises(ModelLoadError) as info:
        parse_simulated(source)
    assert needle in str(info.value)
    assert source in str(info.value)


# --- text ---------------------------------------------------------------------------------


async def test_text_is_deterministic_per_prompt_and_seed() -> None:
    engine, _ = await loaded()
    a1, _ = await run(engine, "tell me a story")
    a2, _ = await run(engine, "tell me a story")
    b, _ = await run(engine, "something else entirely")
    seeded, _ = await run(engine, "tell me a story", seed=3)
    assert a1 == a2
    assert a1 != b
    assert a1 != seeded


async def test_max_tokens_is_honoured_and_counted() -> None:
    engine, _ = await loaded()
    text, done = await run(engine, "one two three", max_tokens=5)
    assert len(text.split()) == 5
    assert done == Done("length", 3, 5)


async def test_stop_sequence_ends_generation_without_the_stop_text() -> None:
    engine, _ = await loaded()
    full, _ = await run(engine, "a prompt", max_tokens=12)
    words = full.split()
    stop_word = words[3]
    first = words.index(stop_word)
    text, done = await run(engine, "a prompt", max_tokens=12, stop=(" " + stop_word,))
    assert done.finish_reason == "stop"
    assert text == " ".join(words[:first])
    assert done.completion_tokens == first + 1


def test_tokens_are_whitespace_words_and_chat_is_joined() -> None:
    engine = SimulatedEngine()
    assert engine.count_tokens("  hello   big\nworld ") == 3
    prompt = engine.render_chat([ChatMessage("system", "be brief"), ChatMessage("user", "hi")])
    assert prompt == "system: be brief\nuser: hi\nassistant:"


# --- timing model ---------------------------------------------------------------------------


async def test_sleeps_follow_the_timing_model() -> None:
    opts = SimulatedOptions(fixed_ms=20, prefill_ms=1, decode_ms=10)
    engine, sleep = await loaded(opts)
    await run(engine, "w " * 30, max_tokens=3)
    assert sleep.delays == pytest.approx([0.05, 0.01, 0.01, 0.01])


async def test_steps_slow_down_past_the_knee() -> None:
    engine, sleep = await loaded(SimulatedOptions(decode_ms=10, knee=2, prefill_ms=0))
    params = GenerationParams(max_tokens=2)
    streams = [engine.stream("p", params) for _ in range(4)]
    for s in streams:  # all four inside the engine: 4 active, knee 2 -> steps twice as long
        await anext(s)
    assert engine.max_active == 4
    assert sleep.delays[-1] == pytest.approx(0.02)
    for s in streams:
        await s.aclose()
    assert engine.active == 0
    sleep.delays.clear()
    await run(engine, "p", max_tokens=2)
    assert sleep.delays[1:] == pytest.approx([0.01, 0.01])


async def test_load_waits_load_s() -> None:
    engine = SimulatedEngine(SimulatedOptions(load_s=2.5), sleep=(sleep := RecordingSleep()))
    assert engine.probe.read().used_bytes == 0  # type: ignore[union-attr]
    await engine.load()
    assert sleep.delays == [2.5]


# --- memory model ---------------------------------------------------------------------------


async def test_memory_rises_with_tokens_in_flight_and_falls_after() -> None:
    opts = SimulatedOptions(weights_mb=100, kv_kb_per_token=1024, total_mb=1000)
    engine, _ = await loaded(opts)
    assert engine.probe.read().used_bytes == 100 * MB  # type: ignore[union-attr]
    stream = engine.stream("a b c d", GenerationParams(max_tokens=10))
    events: list[Event] = [await anext(stream), await anext(stream)]
    assert all(isinstance(e, Delta) for e in events)
    # weights + (4 prompt + 2 generated) tokens of 1 MiB each
    assert engine.probe.read().used_bytes == 106 * MB  # type: ignore[union-attr]
    await stream.aclose()
    reading = engine.probe.read()
    assert reading is not None
    assert reading.used_bytes == 100 * MB
    assert reading.free_bytes == 900 * MB
    assert engine.peak_memory_bytes() == 106 * MB


async def test_out_of_memory_fails_that_request_only() -> None:
    opts = SimulatedOptions(weights_mb=100, kv_kb_per_token=1024, total_mb=110)
    engine, _ = await loaded(opts)
    with pytest.raises(EngineOutOfMemory, match="out of device memory"):
        await run(engine, "w " * 20)
    assert engine.probe.read().used_bytes == 100 * MB  # type: ignore[union-attr]
    _, done = await run(engine, "small prompt", max_tokens=3)
    assert done.completion_tokens == 3


async def test_out_of_memory_mid_generation_when_others_hold_the_memory() -> None:
    opts = SimulatedOptions(weights_mb=100, kv_kb_per_token=1024, total_mb=110)
    engine, _ = await loaded(opts)
    holder = engine.stream("a b c d e f", GenerationParams(max_tokens=50))
    await anext(holder)  # holds 7 MiB
    with pytest.raises(EngineOutOfMemory):
        await run(engine, "x", max_tokens=5)  # 1 + 2 fit, the third token does not
    assert engine.probe.read().used_bytes == 107 * MB  # type: ignore[union-attr]
    await holder.aclose()
    assert engine.active == 0
    assert engine.probe.read().used_bytes == 100 * MB  # type: ignore[union-attr]
