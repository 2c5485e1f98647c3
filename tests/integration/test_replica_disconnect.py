"""Clients that go away, over real sockets (uvicorn in the test's loop): a queued request never
runs; a streaming or running request stops and frees its slot."""

from __future__ import annotations

import asyncio
import logging

import httpx
import pytest

from replica.app import create_app
from replica.simulated import SimulatedEngine, SimulatedOptions
from tests.integration.replica_harness import (
    blocking_app,
    make_settings,
    read_then_leave,
    serve,
    state_of,
    wait_until,
)

GEN = {"text": "hello", "max_tokens": 2}


async def test_client_gone_while_queued_never_runs() -> None:
    app, engine = blocking_app(max_concurrency=1, max_queue=8)
    gate = state_of(app).gate
    async with serve(app) as url, httpx.AsyncClient(base_url=url, timeout=10) as client:
        first = asyncio.create_task(client.post("/generate", json=GEN))
        await wait_until(lambda: engine.started == 1, what="first inside")
        leaver = asyncio.create_task(client.post("/generate", json={**GEN, "text": "leaver"}))
        await wait_until(lambda: gate.queued == 1, what="second queued")
        leaver.cancel()  # the client closes its connection
        await wait_until(lambda: gate.queued == 0, what="leaver left the queue")
        engine.release.set()
        assert (await asyncio.wait_for(first, 5)).status_code == 200
        later = await client.post("/generate", json=GEN)
        metrics = (await client.get("/metrics")).text
    assert later.status_code == 200
    # FIFO: had the leaver stayed queued it would have run before `later`.
    assert engine.started == 2
    assert gate.in_flight == 0
    assert 'gpupool_replica_rejections_total{reason="client_gone"} 1.0' in metrics


async def test_client_gone_mid_stream_stops_generation_and_frees_the_slot(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="replica.access")
    engine = SimulatedEngine(SimulatedOptions(decode_ms=20, prefill_ms=0))
    app = create_app(make_settings(max_concurrency=1), engine=engine)
    gate = state_of(app).gate
    payload = {"prompt": "go", "max_tokens": 500, "stream": True}
    async with serve(app) as url, httpx.AsyncClient(base_url=url, timeout=10) as client:
        await read_then_leave(client, payload, "cut-1")
        await wait_until(lambda: engine.active == 0 and gate.in_flight == 0, what="slot freed")
        after = await client.post("/generate", json={"text": "x", "max_tokens": 1})
        whole = await client.post(
            "/v1/completions", json={**payload, "max_tokens": 2}, headers={"X-Request-ID": "all"}
        )
    assert after.status_code == 200
    assert whole.text.endswith("data: [DONE]\n\n")
    assert gate.completed == 3
    logged = [r.getMessage() for r in caplog.records if r.name == "replica.access"]
    cut = [line for line in logged if line.startswith("id=cut-1 ")]
    assert len(cut) == 1
    assert "status=200" in cut[0] and cut[0].endswith(" stream_error=client_gone")
    finished = [line for line in logged if "/generate" in line or line.startswith("id=all ")]
    assert len(finished) == 2 and not any("stream_error" in line for line in finished)


async def test_client_gone_during_a_plain_request_stops_generation() -> None:
    app, engine = blocking_app(max_concurrency=1)
    gate = state_of(app).gate
    async with serve(app) as url, httpx.AsyncClient(base_url=url, timeout=10) as client:
        leaver = asyncio.create_task(client.post("/generate", json=GEN))
        await wait_until(lambda: engine.active == 1, what="request inside")
        leaver.cancel()
        await wait_until(lambda: engine.active == 0 and gate.in_flight == 0, what="stopped")
    assert engine.closed_early == 1
