"""The replica's HTTP surface in-process: OpenAI shapes, SSE, request ids, every input limit."""

from __future__ import annotations

import gzip
import json
import logging
import zlib
from collections.abc import AsyncIterator

import httpx
import pytest

from replica.app import create_app
from tests.integration.replica_harness import client_for, make_settings, sse_events

LIMITS = {
    "max_input_tokens": 20,
    "max_input_chars": 200,
    "max_new_tokens": 32,
    "max_body_bytes": 4096,
}


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    app = create_app(make_settings("simulated:decode_ms=0,prefill_ms=0", **LIMITS))
    async with client_for(app) as c:
        yield c


JSON = {"content-type": "application/json"}
CHAT = {"messages": [{"role": "user", "content": "hello there"}], "max_tokens": 4}


async def test_completion_shape_and_usage(client: httpx.AsyncClient) -> None:
    r = await client.post("/v1/completions", json={"prompt": "one two three", "max_tokens": 5})
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "text_completion"
    assert body["model"] == "simulated"
    choice = body["choices"][0]
    assert len(choice["text"].split()) == 5
    assert choice["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8}


async def test_prompt_as_a_list_of_one_string(client: httpx.AsyncClient) -> None:
    r = await client.post("/v1/completions", json={"prompt": ["one two"], "max_tokens": 2})
    assert r.status_code == 200
    assert r.json()["usage"]["prompt_tokens"] == 2


async def test_chat_shape_usage_and_unknown_fields_ignored(client: httpx.AsyncClient) -> None:
    payload = {**CHAT, "user": "u1", "logit_bias": {}, "frequency_penalty": 0, "model": "x"}
    r = await client.post("/v1/chat/completions", json=payload)
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "chat.completion"
    message = body["choices"][0]["message"]
    assert message["role"] == "assistant"
    assert len(message["content"].split()) == 4
    # "user: hello there\nassistant:" is 4 whitespace words
    assert body["usage"] == {"prompt_tokens": 4, "completion_tokens": 4, "total_tokens": 8}


async def test_max_completion_tokens_wins_and_stop_applies(client: httpx.AsyncClient) -> None:
    r = await client.post("/v1/chat/completions", json={**CHAT, "max_completion_tokens": 6})
    words = r.json()["choices"][0]["message"]["content"].split()
    assert len(words) == 6
    cut = words.index(words[2])
    payload = {**CHAT, "max_tokens": 6, "stop": [" " + words[2]]}
    body = (await client.post("/v1/chat/completions", json=payload)).json()
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["choices"][0]["message"]["content"] == " ".join(words[:cut])


async def test_generate_simple_form(client: httpx.AsyncClient) -> None:
    r = await client.post("/generate", json={"text": "a b", "max_tokens": 3})
    assert r.status_code == 200
    body = r.json()
    assert len(body["result"].split()) == 3
    assert body["usage"]["completion_tokens"] == 3


async def test_stream_chat_with_usage_ends_with_done(client: httpx.AsyncClient) -> None:
    payload = {**CHAT, "stream": True, "stream_options": {"include_usage": True}}
    r = await client.post("/v1/chat/completions", json=payload)
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert len(text.split()) == 4
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert finishes[-1] == "length"
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"]["completion_tokens"] == 4


async def test_stream_completion_without_usage(client: httpx.AsyncClient) -> None:
    r = await client.post(
        "/v1/completions", json={"prompt": "a b c", "max_tokens": 3, "stream": True}
    )
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "text_completion" and "usage" not in c for c in chunks)
    assert len("".join(c["choices"][0]["text"] for c in chunks).split()) == 3
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


async def test_request_id_echoed_or_created(client: httpx.AsyncClient) -> None:
    given = await client.post(
        "/generate", json={"text": "x", "max_tokens": 1}, headers={"X-Request-ID": "abc-123"}
    )
    assert given.headers["x-request-id"] == "abc-123"
    made = await client.post("/generate", json={"text": "x", "max_tokens": 1})
    assert len(made.headers["x-request-id"]) >= 16
    bad = await client.post("/generate", json={})
    assert bad.headers["x-request-id"]


async def test_models_lists_the_model(client: httpx.AsyncClient) -> None:
    r = await client.get("/v1/models")
    assert r.status_code == 200
    assert [m["id"] for m in r.json()["data"]] == ["simulated"]


# --- limits and bad input: status, and a message naming the limit and the value -------------


@pytest.mark.parametrize(
    ("path", "payload", "status", "needles"),
    [
        ("/v1/completions", {"prompt": "w " * 21}, 400, ["21 tokens", "20", "max_input_tokens"]),
        (
            "/v1/completions",
            {"prompt": "x" * 201},
            400,
            ["201 characters", "200", "max_input_chars"],
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "y" * 300}]},
            400,
            ["300 characters", "max_input_chars"],
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "w " * 19}]},
            400,
            ["21 tokens", "max_input_tokens"],
        ),
        (  # empty contents, but the rendered chat is long: refused before tokenizing it
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": ""}] * 40},
            400,
            ["messages is 290 characters", "limit of 200 characters", "max_input_chars"],
        ),
        (
            "/v1/completions",
            {"prompt": "hi", "max_tokens": 33},
            400,
            ["max_tokens is 33", "32", "max_new_tokens"],
        ),
        (
            "/v1/chat/completions",
            {**CHAT, "max_completion_tokens": 99},
            400,
            ["max_completion_tokens is 99", "max_new_tokens"],
        ),
        ("/generate", {"text": "hi", "max_tokens": 500}, 400, ["max_tokens is 500"]),
        ("/v1/completions", {"prompt": ""}, 400, ["prompt must not be empty"]),
        ("/v1/completions", {"prompt": ["a", "b"]}, 400, ["list of 2 strings"]),
        ("/v1/chat/completions", {"messages": []}, 400, ["messages must not be empty"]),
        ("/generate", {"text": ""}, 400, ["text must not be empty"]),
        ("/v1/completions", {"prompt": "hi", "n": 2}, 400, ["n must be 1"]),
        (
            "/v1/chat/completions",
            {
                "messages": [
                    {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}
                ]
            },
            400,
            ["only text parts"],
        ),
        ("/v1/completions", {"prompt": 5}, 422, ["prompt"]),
        ("/v1/completions", {"prompt": "hi", "max_tokens": "many"}, 422, ["max_tokens"]),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, 422, ["max_tokens", "got 0"]),
        ("/v1/completions", {"prompt": "hi", "max_tokens": True}, 422, ["max_tokens", "got True"]),
        ("/generate", {"text": "hi", "temperature": "0.5"}, 422, ["temperature", "got '0.5'"]),
        ("/v1/chat/completions", {**CHAT, "stream": "yes"}, 422, ["stream", "got 'yes'"]),
        ("/v1/completions", {"prompt": "hi", "temperature": 3}, 422, ["temperature", "got 3"]),
        (
            "/v1/completions",
            {"prompt": "hi", "seed": 2**64},
            422,
            ["seed", "18446744073709551615", "got 18446744073709551616"],
        ),
        ("/generate", {"text": "hi", "seed": -(2**63) - 1}, 422, ["seed", "greater than"]),
        ("/v1/completions", {"prompt": "a \ud800 b"}, 400, ["prompt is not valid Unicode"]),
        ("/generate", {"text": "\udfff"}, 400, ["text is not valid Unicode", "at character 0"]),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "ok \ud83d"}]},
            400,
            ["messages is not valid Unicode", "unpaired surrogate"],
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
            400,
            ["messages.0.content", "needs a 'text' string"],
        ),
        ("/v1/completions", {"max_tokens": 3}, 422, ["prompt", "required"]),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "wizard", "content": "x"}]},
            422,
            ["messages.0.role"],
        ),
        ("/v1/chat/completions", {"messages": "hello"}, 422, ["messages"]),
        ("/generate", [1, 2], 422, ["body"]),
    ],
)
async def test_bad_input_is_a_clear_4xx(
    client: httpx.AsyncClient, path: str, payload: object, status: int, needles: list[str]
) -> None:
    # json.dumps escapes non-ASCII (httpx's json= would refuse a lone surrogate)
    r = await client.post(path, content=json.dumps(payload), headers=JSON)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error"
    for needle in needles:
        assert needle in error["message"]


async def test_malformed_json_is_400(client: httpx.AsyncClient) -> None:
    r = await client.post(
        "/v1/completions", content=b'{"prompt": ', headers={"content-type": "application/json"}
    )
    assert r.status_code == 400
    assert "not valid JSON" in r.json()["error"]["message"]


async def test_body_over_the_cap_is_413_by_header_and_by_bytes(client: httpx.AsyncClient) -> None:
    big = b'{"prompt": "' + b"x" * 5000 + b'"}'
    declared = await client.post("/v1/completions", content=big)
    assert declared.status_code == 413
    assert "4096 bytes" in declared.json()["error"]["message"]

    async def chunks() -> AsyncIterator[bytes]:  # no Content-Length: counted as read
        for i in range(0, len(big), 1000):
            yield big[i : i + 1000]

    streamed = await client.post("/v1/completions", content=chunks())
    assert streamed.status_code == 413
    message = streamed.json()["error"]["message"]
    assert "at least 5000 bytes, above the limit of 4096 bytes (max_body_bytes)" in message


async def test_gzip_and_deflate_bodies_are_decoded_under_the_same_cap(
    client: httpx.AsyncClient,
) -> None:
    payload = json.dumps({"prompt": "one two", "max_tokens": 2}).encode()
    gz = await client.post(
        "/v1/completions",
        content=gzip.compress(payload),
        headers={**JSON, "content-encoding": "gzip"},
    )
    deflated = await client.post(
        "/v1/completions",
        content=zlib.compress(payload),
        headers={**JSON, "content-encoding": "deflate"},
    )
    bomb = await client.post(
        "/v1/completions",
        content=gzip.compress(b" " * 100_000 + payload),
        headers={**JSON, "content-encoding": "gzip"},
    )
    broken = await client.post(
        "/v1/completions", content=payload, headers={**JSON, "content-encoding": "gzip"}
    )
    brotli = await client.post(
        "/v1/completions", content=payload, headers={**JSON, "content-encoding": "br"}
    )
    assert (gz.status_code, deflated.status_code) == (200, 200)
    assert gz.json()["usage"]["prompt_tokens"] == 2
    assert bomb.status_code == 413
    assert "more than 4096 bytes once decompressed" in bomb.json()["error"]["message"]
    assert broken.status_code == 400
    assert "not valid gzip" in broken.json()["error"]["message"]
    assert brotli.status_code == 400
    assert "Content-Encoding 'br' is not supported" in brotli.json()["error"]["message"]


async def test_unknown_route_and_method_are_error_bodies(client: httpx.AsyncClient) -> None:
    missing = await client.get("/v2/nothing")
    assert missing.status_code == 404
    assert missing.json()["error"]["type"] == "not_found_error"
    wrong = await client.get("/v1/completions")
    assert wrong.status_code == 405
    assert "error" in wrong.json()


async def test_metrics_count_requests_tokens_and_errors(client: httpx.AsyncClient) -> None:
    await client.post("/v1/completions", json={"prompt": "a b c", "max_tokens": 2})
    await client.post("/v1/completions", json={"prompt": ""})
    text = (await client.get("/metrics")).text
    assert 'gpupool_replica_requests_total{route="/v1/completions",status="200"} 1.0' in text
    assert 'gpupool_replica_errors_total{status="400"} 1.0' in text
    assert "gpupool_replica_prompt_tokens_total 3.0" in text
    assert "gpupool_replica_completion_tokens_total 2.0" in text
    for name in (
        "gpupool_replica_request_duration_seconds_bucket",
        "gpupool_replica_queue_wait_seconds_count 1.0",
        "gpupool_replica_time_to_first_token_seconds_count 1.0",
        "gpupool_replica_in_flight 0.0",
        "gpupool_replica_queued 0.0",
        "gpupool_replica_ready 1.0",
        "gpupool_replica_peak_memory_bytes",
        "gpupool_replica_memory_used_bytes",
    ):
        assert name in text


async def test_one_access_log_line_per_request(
    client: httpx.AsyncClient, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="replica.access")
    await client.post(
        "/v1/completions",
        json={"prompt": "a b c", "max_tokens": 2},
        headers={"X-Request-ID": "log-me"},
    )
    await client.post("/v1/completions", json={"prompt": ""}, headers={"X-Request-ID": "bad-one"})
    lines = [r.getMessage() for r in caplog.records if r.name == "replica.access"]
    assert len(lines) == 2
    ok, bad = lines
    assert ok.startswith("id=log-me POST /v1/completions status=200 queue_ms=0.0 ")
    assert "prompt_tokens=3 completion_tokens=2" in ok
    assert "duration_ms=" in ok
    assert bad.startswith("id=bad-one POST /v1/completions status=400 queue_ms=- ")
