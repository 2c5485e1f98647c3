"""The router's request log: one line per request with its id; probes stay out of INFO."""

from __future__ import annotations

import logging

import httpx
import pytest
from starlette.types import Receive, Scope, Send

from router.requestlog import RequestLog


async def _answer(scope: Scope, receive: Receive, send: Send) -> None:
    status = 503 if scope["path"] == "/health" else 200
    await send({"type": "http.response.start", "status": status, "headers": []})
    await send({"type": "http.response.body", "body": b"{}"})


async def test_one_info_line_per_request_and_probes_only_at_debug(
    caplog: pytest.LogCaptureFixture,
) -> None:
    app = RequestLog(_answer, clock=lambda: 0.0)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://router") as client:
        with caplog.at_level(logging.INFO, logger="gpupool.router"):
            r = await client.post("/v1/completions", headers={"X-Request-ID": "req-7"})
            for _ in range(5):  # a draining router answers probes 503: not a log flood
                await client.get("/health")
                await client.get("/metrics")
    assert r.headers["x-request-id"] == "req-7"
    lines = [rec.getMessage() for rec in caplog.records if rec.name == "gpupool.router"]
    assert len(lines) == 1
    assert lines[0].startswith("req-7 POST /v1/completions 200")
