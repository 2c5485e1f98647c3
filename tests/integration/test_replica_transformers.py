"""The replica app around the real TransformersEngine (builtin:tiny-random, CPU): an injected
device OOM fails one request with 503 and the replica goes on serving."""

from __future__ import annotations

from typing import Any

import pytest

from replica.app import create_app
from tests.integration.replica_harness import client_for, make_settings, sse_events, state_of

torch = pytest.importorskip("torch")
transformers_engine = pytest.importorskip("replica.transformers_engine")


async def test_injected_cuda_oom_fails_one_request_and_the_next_succeeds() -> None:
    engine = transformers_engine.TransformersEngine("builtin:tiny-random", "cpu")
    app = create_app(make_settings("builtin:tiny-random"), engine=engine)
    async with client_for(app) as client:
        model = engine._model
        original = model.forward
        failures = {"left": 2}

        def flaky(*args: Any, **kwargs: Any) -> Any:
            if failures["left"]:
                failures["left"] -= 1
                raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 20 GiB")
            return original(*args, **kwargs)

        model.forward = flaky
        try:
            failed = await client.post("/generate", json={"text": "hello", "max_tokens": 4})
            failed_stream = await client.post(
                "/v1/chat/completions",
                json={
                    "messages": [{"role": "user", "content": "hi"}],
                    "stream": True,
                    "max_tokens": 4,
                },
            )
            ok = await client.post("/generate", json={"text": "hello", "max_tokens": 4})
            streamed = await client.post(
                "/v1/completions", json={"prompt": "hello", "max_tokens": 4, "stream": True}
            )
            health = await client.get("/health")
        finally:
            model.forward = original
    assert failed.status_code == 503
    assert failed.json()["error"]["code"] == "out_of_memory"
    assert "out of memory" in failed.json()["error"]["message"]
    assert failed_stream.status_code == 503
    assert ok.status_code == 200
    assert ok.json()["usage"]["completion_tokens"] >= 1
    assert sse_events(streamed.text)[-1] == "[DONE]"
    assert health.status_code == 200
    assert state_of(app).gate.in_flight == 0
