"""Admission, readiness and failures through HTTP, counted inside the engine (no timing)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

import pytest

from replica.app import create_app
from replica.engine import ChatMessage, GenerationParams
from replica.errors import EngineOutOfMemory
from replica.simulated import SimulatedEngine, SimulatedOptions
from tests.integration.replica_harness import (
    BlockingEngine,
    blocking_app,
    client_for,
    gather_bounded,
    make_settings,
    sse_events,
    state_of,
    wait_until,
)

GEN = {"text": "hello", "max_tokens": 2}


async def test_never_more_than_max_concurrency_inside_the_engine_under_60_requests() -> None:
    engine = SimulatedEngine(SimulatedOptions(decode_ms=1, prefill_ms=0))
    app = create_app(make_settings(max_concurrency=3, max_queue=100), engine=engine)
    async with client_for(app) as client:
        replies = await gather_bounded(
            [client.post("/generate", json={"text": f"r{i}", "max_tokens": 3}) for i in range(60)]
        )
        health = (await client.get("/health")).json()
    assert [r.status_code for r in replies] == [200] * 60
    assert engine.started == 60
    assert engine.max_active == 3
    assert (health["in_flight"], health["queued"], health["completed"]) == (0, 0, 60)


async def test_burst_past_the_queue_gets_429_with_retry_after_and_json() -> None:
    app, engine = blocking_app(max_concurrency=1, max_queue=2)
    async with client_for(app) as client:
        tasks = [asyncio.create_task(client.post("/generate", json=GEN)) for _ in range(20)]
        await wait_until(lambda: sum(t.done() for t in tasks) == 17, what="17 rejected")
        state = state_of(app)
        assert (state.gate.in_flight, state.gate.queued) == (1, 2)
        rejected = [t.result() for t in tasks if t.done()]
        engine.release.set()
        accepted = await gather_bounded(tasks)
        metrics = (await client.get("/metrics")).text
    assert {r.status_code for r in rejected} == {429}
    for r in rejected:
        assert int(r.headers["retry-after"]) >= 1
        error = r.json()["error"]
        assert error["type"] == "rate_limit_error"
        assert "queue is full (2/2)" in error["message"]
    assert sum(r.status_code == 200 for r in accepted) == 3
    assert engine.started == 3
    assert 'gpupool_replica_rejections_total{reason="queue_full"} 17.0' in metrics


async def test_queue_timeout_is_503_saying_so_and_never_runs() -> None:
    app, engine = blocking_app(max_concurrency=1, max_queue=4, queue_timeout_s=0.1)
    async with client_for(app) as client:
        first = asyncio.create_task(client.post("/generate", json=GEN))
        await wait_until(lambda: engine.started == 1, what="first inside")
        waited = await client.post("/generate", json=GEN)
        engine.release.set()
        assert (await asyncio.wait_for(first, 5)).status_code == 200
    assert waited.status_code == 503
    error = waited.json()["error"]
    assert error["code"] == "queue_timeout"
    assert "waited 0.1 s in the queue" in error["message"]
    assert engine.started == 1


async def test_health_is_503_loading_then_200_ready_and_never_runs_the_model(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="replica.access")
    load_gate = asyncio.Event()
    engine = BlockingEngine(load_gate=load_gate)
    app = create_app(make_settings(max_concurrency=2, max_queue=7), engine=engine)
    async with client_for(app, ready=False) as client:
        loading = await client.get("/health")
        refused = await client.post("/generate", json=GEN)
        load_gate.set()
        await wait_until(lambda: state_of(app).status == "ready")
        ready = await client.get("/health")
    logged = [r.getMessage() for r in caplog.records if r.name == "replica.access"]
    assert len(logged) == 1 and " POST /generate status=503 " in logged[0]  # polls stay quiet
    assert loading.status_code == 503
    assert loading.json()["status"] == "loading"
    assert loading.json()["ready"] is False
    assert refused.status_code == 503
    assert "loading" in refused.json()["error"]["message"]
    assert ready.status_code == 200
    body = ready.json()
    assert body["ready"] is True
    assert body["status"] == "ready"
    assert body["device"] == "cpu"
    assert body["model"] == "blocking"
    assert (body["max_concurrency"], body["max_queue"]) == (2, 7)
    assert (body["in_flight"], body["queued"], body["draining"]) == (0, 0, False)
    assert body["memory"] is None  # CPU: no NVML reading
    assert body["uptime_s"] >= 0
    assert engine.started == 0


async def test_failed_load_reports_failed_with_the_error() -> None:
    engine = BlockingEngine()
    engine.load_error = RuntimeError("weights are corrupt")
    app = create_app(make_settings(), engine=engine)
    async with client_for(app, ready=False) as client:
        await wait_until(lambda: state_of(app).status == "failed")
        health = await client.get("/health")
        refused = await client.post("/generate", json=GEN)
    assert health.status_code == 503
    assert health.json()["status"] == "failed"
    assert "weights are corrupt" in health.json()["error"]
    assert refused.status_code == 503
    assert "failed to load" in refused.json()["error"]["message"]


async def test_simulated_memory_shows_in_health_while_a_request_runs() -> None:
    opts = SimulatedOptions(weights_mb=100, kv_kb_per_token=1024, total_mb=1000, decode_ms=0)
    engine = SimulatedEngine(opts)
    app = create_app(make_settings(), engine=engine)
    async with client_for(app) as client:
        idle = (await client.get("/health")).json()
        stream = engine.stream("a b", GenerationParams(max_tokens=5))
        await anext(stream)
        busy = (await client.get("/health")).json()
        await stream.aclose()
        after = (await client.get("/health")).json()
    mib = 1024 * 1024
    assert idle["memory"] == {
        "used_bytes": 100 * mib,
        "total_bytes": 1000 * mib,
        "free_bytes": 900 * mib,
    }
    assert busy["memory"]["used_bytes"] == 103 * mib
    assert after["memory"]["used_bytes"] == 100 * mib
    assert after["peak_memory_bytes"] == 103 * mib


async def test_queued_requests_hold_no_device_memory() -> None:
    release = asyncio.Event()

    async def sleep(_: float) -> None:
        await release.wait()  # every simulated step waits until the test lets it go

    opts = SimulatedOptions(weights_mb=100, kv_kb_per_token=1024, total_mb=1000)
    engine = SimulatedEngine(opts, sleep=sleep)
    app = create_app(make_settings(max_concurrency=1, max_queue=10), engine=engine)
    prompt = {"text": "one two three four", "max_tokens": 2}
    async with client_for(app) as client:
        tasks = [asyncio.create_task(client.post("/generate", json=prompt)) for _ in range(6)]
        await wait_until(
            lambda: state_of(app).gate.queued == 5 and engine.active == 1,
            what="1 inside the engine, 5 queued",
        )
        busy = (await client.get("/health")).json()
        started_while_busy = engine.started
        release.set()
        replies = await gather_bounded(tasks)
    mib = 1024 * 1024
    assert (busy["in_flight"], busy["queued"]) == (1, 5)
    # weights + the KV of the running request's 4 prompt tokens; nothing for the queue
    assert busy["memory"]["used_bytes"] == (100 + 4) * mib
    assert started_while_busy == 1
    assert [r.status_code for r in replies] == [200] * 6


async def test_out_of_memory_fails_one_request_and_the_next_succeeds() -> None:
    source = "simulated:decode_ms=0,weights_mb=100,kv_kb_per_token=1024,total_mb=130"
    app = create_app(make_settings(source, max_input_tokens=1000))
    async with client_for(app) as client:
        huge = await client.post("/generate", json={"text": "w " * 50, "max_tokens": 2})
        streamed = await client.post(
            "/v1/completions", json={"prompt": "w " * 50, "max_tokens": 2, "stream": True}
        )
        fine = await client.post("/generate", json={"text": "w " * 5, "max_tokens": 2})
        health = await client.get("/health")
    assert huge.status_code == 503
    assert huge.json()["error"]["code"] == "out_of_memory"
    assert "out of device memory" in huge.json()["error"]["message"]
    assert streamed.status_code == 503  # the first event is pulled before the 200 goes out
    assert fine.status_code == 200
    assert health.status_code == 200
    assert health.json()["in_flight"] == 0


async def test_error_after_the_stream_started_ends_with_an_error_event() -> None:
    app, engine = blocking_app()
    engine.release.set()
    engine.fail_with = EngineOutOfMemory("out of device memory (test)")
    engine.fail_after = 1
    async with client_for(app) as client:
        r = await client.post(
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "hi"}], "stream": True},
        )
        after = await client.post("/generate", json=GEN)
    assert r.status_code == 200
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    assert events[-2]["error"]["code"] == "out_of_memory"
    assert events[1]["choices"][0]["delta"]["content"] == "w0 "
    assert after.status_code == 200
    assert state_of(app).gate.in_flight == 0


async def test_request_timeout_is_504_stops_generation_and_frees_the_slot() -> None:
    app, engine = blocking_app(request_timeout_s=0.1, max_concurrency=1)
    async with client_for(app) as client:
        timed_out = await client.post("/generate", json=GEN)
        streamed = await client.post(
            "/v1/completions", json={"prompt": "x", "max_tokens": 2, "stream": True}
        )
        assert (engine.active, state_of(app).gate.in_flight) == (0, 0)
        engine.release.set()
        after = await client.post("/generate", json=GEN)
    assert timed_out.status_code == 504
    assert timed_out.json()["error"]["type"] == "timeout_error"
    assert "request deadline of 0.1 s" in timed_out.json()["error"]["message"]
    assert streamed.status_code == 504  # nothing generated before the deadline: a real status
    assert engine.closed_early == 2
    assert after.status_code == 200


async def test_timeout_mid_stream_is_an_sse_error_event() -> None:
    source = "simulated:decode_ms=40,prefill_ms=0"
    app = create_app(make_settings(source, request_timeout_s=0.5))
    engine = state_of(app).engine
    assert isinstance(engine, SimulatedEngine)
    async with client_for(app) as client:
        r = await client.post(
            "/v1/completions", json={"prompt": "x", "max_tokens": 200, "stream": True}
        )
    events = sse_events(r.text)
    assert r.status_code == 200
    assert events[-1] == "[DONE]"
    assert events[-2]["error"]["type"] == "timeout_error"
    assert 1 <= len(events) - 2 < 200
    assert engine.active == 0
    assert state_of(app).gate.in_flight == 0


async def test_drain_refuses_new_work_lets_running_finish_and_undrain_resumes() -> None:
    app, engine = blocking_app(max_concurrency=1)
    async with client_for(app) as client:
        running = asyncio.create_task(client.post("/generate", json=GEN))
        await wait_until(lambda: engine.started == 1)
        drained = await client.post("/admin/drain")
        health = await client.get("/health")
        refused = await client.post("/generate", json=GEN)
        engine.release.set()
        finished = await asyncio.wait_for(running, 5)
        await client.post("/admin/undrain")
        healthy = await client.get("/health")
        again = await client.post("/generate", json=GEN)
        metrics = (await client.get("/metrics")).text
    assert drained.status_code == 200
    assert health.status_code == 503
    assert (health.json()["status"], health.json()["draining"]) == ("draining", True)
    assert refused.status_code == 503
    assert "draining" in refused.json()["error"]["message"]
    assert finished.status_code == 200
    assert healthy.status_code == 200
    assert again.status_code == 200
    assert 'gpupool_replica_rejections_total{reason="draining"} 1.0' in metrics


async def test_client_sees_503_json_not_a_hang_when_queue_is_zero_and_busy() -> None:
    app, engine = blocking_app(max_concurrency=1, max_queue=0)
    async with client_for(app) as client:
        first = asyncio.create_task(client.post("/generate", json=GEN))
        await wait_until(lambda: engine.started == 1)
        second = await client.post("/generate", json=GEN)
        engine.release.set()
        await asyncio.wait_for(first, 5)
    assert second.status_code == 429
    assert isinstance(second.json()["error"]["message"], str)


class BuggyEngine(BlockingEngine):
    def count_tokens(self, text: str) -> int:
        raise ZeroDivisionError("a bug")


async def test_a_bug_is_a_500_error_body_and_the_replica_stays_up() -> None:
    app, _ = blocking_app(BuggyEngine())
    async with client_for(app) as client:
        r = await client.post("/generate", json=GEN, headers={"X-Request-ID": "bug-1"})
        health = await client.get("/health")
    assert r.status_code == 500
    assert r.json()["error"] == {
        "message": "internal error: ZeroDivisionError",
        "type": "server_error",
        "param": None,
        "code": "internal_error",
    }
    assert r.headers["x-request-id"] == "bug-1"
    assert health.status_code == 200


class PickyTemplateEngine(BlockingEngine):
    def render_chat(self, messages: Sequence[ChatMessage]) -> str:
        if any(m.role == "tool" for m in messages):
            raise ValueError("Conversation roles must alternate user/assistant")
        return super().render_chat(messages)


async def test_a_chat_template_refusal_is_a_400_naming_the_reason() -> None:
    app, engine = blocking_app(PickyTemplateEngine())
    payload = {"messages": [{"role": "tool", "content": "42"}]}
    async with client_for(app) as client:
        r = await client.post("/v1/chat/completions", json=payload)
    assert r.status_code == 400
    assert "roles must alternate" in r.json()["error"]["message"]
    assert engine.started == 0
