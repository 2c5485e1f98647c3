"""bench.client: what one request's answer becomes (SSE timing, usage, 429, OOM), and CLI errors."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator

import httpx
import pytest

from bench import ladder, tune
from bench.client import RequestSpec, send
from bench.workload import Prompt


def sse(*events: object) -> bytes:
    return b"".join(f"data: {json.dumps(e)}\n\n".encode() for e in events) + b"data: [DONE]\n\n"


def ticking() -> Callable[[], float]:
    """A clock that advances one second per reading."""
    counter: Iterator[int] = iter(range(1000))
    return lambda: float(next(counter))


def client_for(status: int, body: bytes, seen: list[dict[str, object]]) -> httpx.AsyncClient:
    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(json.loads(request.content))
        return httpx.Response(status, content=body)

    return httpx.AsyncClient(transport=httpx.MockTransport(handler))


SPEC = RequestSpec(base_url="http://r", endpoint="chat", model="m", max_tokens=8, stream=True)


async def test_stream_timing_follows_chunks_and_tokens_come_from_usage() -> None:
    chunk = {"choices": [{"delta": {"content": "tok"}}]}
    body = sse(
        {"choices": [{"delta": {"role": "assistant"}}]},  # no text: not a token (clock 1)
        chunk,  # first token (clock 2)
        chunk,
        chunk,
        {"choices": [{"delta": {}, "finish_reason": "stop"}]},  # E2E ends here (clock 5)
        {"choices": [], "usage": {"prompt_tokens": 11, "completion_tokens": 5}},  # not timed
    )
    seen: list[dict[str, object]] = []
    async with client_for(200, body, seen) as client:
        r = await send(client, SPEC, Prompt(text="hi"), clock=ticking())
    assert r.ok and r.streamed
    assert r.ttft_s == 2.0 and r.itl_s == (1.0, 1.0) and r.latency_s == 5.0
    assert r.tpot_s == 3.0 / 4  # (E2E - TTFT) / (5 tokens - 1)
    assert (r.prompt_tokens, r.output_tokens) == (11, 5)
    assert seen[0]["stream_options"] == {"include_usage": True}
    assert seen[0]["messages"] == [{"role": "user", "content": "hi"}]


async def test_a_stream_without_any_choice_is_a_failure_as_in_vllm() -> None:
    body = sse({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 0}})
    async with client_for(200, body, []) as client:
        r = await send(client, SPEC, Prompt(text="hi"))
    assert not r.ok and r.failure_key == "no_chunks"


async def test_an_undecodable_answer_is_a_failure_not_a_crash() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, headers={"content-encoding": "gzip"}, content=b"not gzip")

    plain = RequestSpec(base_url="http://r", endpoint="chat", model="m", max_tokens=8, stream=False)
    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
        for spec in (SPEC, plain):
            r = await send(client, spec, Prompt(text="hi"))
            assert not r.ok and r.failure_key == "transport:DecodingError"


async def test_a_plain_200_that_is_not_json_is_named_so() -> None:
    plain = RequestSpec(base_url="http://r", endpoint="chat", model="m", max_tokens=8, stream=False)
    async with client_for(200, b"<html>proxy page</html>", []) as client:
        r = await send(client, plain, Prompt(text="hi"))
    assert not r.ok and r.failure_key == "bad_json"  # not "failed 200: 1"


async def test_rejection_oom_and_stream_error_are_told_apart() -> None:
    prompt = Prompt(text="hi")
    full = json.dumps({"error": {"message": "queue full", "type": "rate_limit_error"}}).encode()
    oom = json.dumps(
        {"error": {"message": "out of device memory: 3 MiB free", "type": "service_unavailable"}}
    ).encode()
    broken = sse({"choices": [{"delta": {"content": "a"}}]}, {"error": {"message": "boom"}})
    async with client_for(429, full, []) as c:
        rejected = await send(c, SPEC, prompt)
    async with client_for(503, oom, []) as c:
        out_of_memory = await send(c, SPEC, prompt)
    async with client_for(200, broken, []) as c:
        stream_error = await send(c, SPEC, prompt)
    assert rejected.rejected and not rejected.ok and not rejected.oom
    assert out_of_memory.oom and out_of_memory.failure_key == "503"
    assert not stream_error.ok and stream_error.failure_key == "stream_error"


@pytest.mark.parametrize(
    "argv",
    [
        ["--url", "http://x", "--levels", "0,2"],
        ["--url", "localhost:8000"],
        ["--url", "http://x", "--requests-per-level", "4", "--duration-s", "2"],
        ["--url", "http://x", "--slo-tpot-ms", "50"],  # TPOT needs --stream
        ["--url", "http://x", "--prompt-tokens", "9:3"],
        ["--url", "http://x", "--prompt-tokens", "100000000"],  # would build GBs of prompts
        ["--url", "http://x", "--levels", "1,3000000000000"],  # a task per client: no memory
        ["--url", "http://x", "--slo-e2e-ms", "nan"],  # would pass every request
        ["--url", "http://x", "--out", __file__],  # a file: found before the run, not after
        ["--url", "http://x", "--sample-interval-s", "1e-9"],  # would flood /health
    ],
)
def test_ladder_refuses_bad_arguments(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        ladder.main(argv)
    assert exc.value.code == 2
    assert "error:" in capsys.readouterr().err


def test_base_url_accepts_the_openai_style() -> None:
    assert ladder.base_url("http://h:8000/v1/") == "http://h:8000"
    assert ladder.base_url("https://h/") == "https://h"


def test_ladder_reports_an_unreachable_server(tmp_path: object) -> None:
    from tests.support import free_port

    url = f"http://127.0.0.1:{free_port()}"
    assert ladder.main(["--url", url, "--levels", "1", "--out", str(tmp_path)]) == 1


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--url", "http://x", "--write"], "--write"),
        (["--url", "http://x", "--headroom-mb", "-5"], "--headroom-mb"),
        (["--url", "http://x", "--min-goodput", "2"], "--min-goodput"),
        (["--url", "http://x", "--up-to", "0"], "--up-to"),
        (["--url", "http://x", "--out", __file__], "--out"),
    ],
)
def test_tune_refuses_bad_arguments(
    argv: list[str], named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        tune.main(argv)
    assert exc.value.code == 2
    assert named in capsys.readouterr().err
