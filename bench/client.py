"""Send one OpenAI-style request and time it as the client sees it.

``send`` never raises for a bad answer: every outcome (2xx, 429, 5xx, timeout, connection error,
an error event in the stream) becomes a ``RequestResult``. The HTTP client and the clock are passed
in (one shared ``httpx.AsyncClient`` per ladder; tests may pass a fake clock).
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx

from bench.stats import RequestResult
from bench.workload import Endpoint, Prompt

Clock = Callable[[], float]

_OOM = re.compile(r"out of (\w+ )?memory", re.IGNORECASE)

_PATHS: dict[Endpoint, str] = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}


@dataclass(frozen=True)
class RequestSpec:
    base_url: str
    endpoint: Endpoint
    model: str
    max_tokens: int
    stream: bool
    api_key: str | None = None
    timeout_s: float = 120.0

    def body(self, prompt: Prompt) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.model,
            "max_tokens": prompt.max_tokens or self.max_tokens,
            **prompt.payload(self.endpoint),
        }
        if self.stream:
            body["stream"] = True
            body["stream_options"] = {"include_usage": True}
        return body

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    @property
    def url(self) -> str:
        return self.base_url.rstrip("/") + _PATHS[self.endpoint]


async def send(
    client: httpx.AsyncClient, spec: RequestSpec, prompt: Prompt, clock: Clock = time.perf_counter
) -> RequestResult:
    start = clock()
    try:
        if spec.stream:
            return await _send_stream(client, spec, prompt, clock, start)
        return await _send_plain(client, spec, prompt, clock, start)
    except httpx.TimeoutException:
        return RequestResult(status=None, error="timeout")
    except httpx.HTTPError as exc:  # connection, protocol, decoding: no usable answer
        return RequestResult(status=None, error=f"transport:{type(exc).__name__}")


async def _send_plain(
    client: httpx.AsyncClient, spec: RequestSpec, prompt: Prompt, clock: Clock, start: float
) -> RequestResult:
    response = await client.post(
        spec.url, json=spec.body(prompt), headers=spec.headers(), timeout=spec.timeout_s
    )
    latency = clock() - start
    if response.status_code != 200:
        return _error_result(response.status_code, response.content)
    try:
        usage = response.json().get("usage") or {}
    except (ValueError, AttributeError):
        return RequestResult(status=None, error="bad_json")  # a 200 that is no answer
    return RequestResult(
        status=200,
        ok=True,
        ttft_s=latency,  # nothing reaches the client before the whole answer
        latency_s=latency,
        output_tokens=_count(usage, "completion_tokens", 0),
        prompt_tokens=_count(usage, "prompt_tokens", 0),
    )


async def _send_stream(
    client: httpx.AsyncClient, spec: RequestSpec, prompt: Prompt, clock: Clock, start: float
) -> RequestResult:
    ttft: float | None = None
    last_text: float | None = None
    first_choice: float | None = None  # events with choices: where E2E ends (the last, as vllm)
    last_choice: float | None = None
    gaps: list[float] = []
    chunks = 0
    usage: dict[str, Any] = {}
    async with client.stream(
        "POST", spec.url, json=spec.body(prompt), headers=spec.headers(), timeout=spec.timeout_s
    ) as response:
        if response.status_code != 200:
            return _error_result(response.status_code, await response.aread())
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            try:
                event = json.loads(data)
            except ValueError:
                continue
            if not isinstance(event, dict):
                continue
            if "error" in event:
                # The answer began and then failed (a 502 in the router's terms).
                oom = is_oom_message(_message(event) or "")
                return RequestResult(status=None, error="stream_error", oom=oom)
            if isinstance(event.get("usage"), dict):
                usage = event["usage"]
            if not event.get("choices"):
                continue
            now = clock()
            first_choice = now if first_choice is None else first_choice
            last_choice = now
            if _has_text(event):
                chunks += 1
                if ttft is None:
                    ttft = now - start
                elif last_text is not None:
                    gaps.append(now - last_text)
                last_text = now
    if first_choice is None or last_choice is None:
        # As vllm: a stream that never carried a choice has nothing to time; a failure.
        return RequestResult(status=None, error="no_chunks")
    return RequestResult(
        status=200,
        ok=True,
        ttft_s=(ttft if ttft is not None else first_choice - start),
        latency_s=last_choice - start,
        itl_s=tuple(gaps),
        output_tokens=_count(usage, "completion_tokens", chunks),
        prompt_tokens=_count(usage, "prompt_tokens", 0),
        streamed=True,
    )


def _count(usage: Any, key: str, default: int) -> int:
    """A token count from a usage object; ``default`` when it is absent or not a number."""
    value = usage.get(key) if isinstance(usage, dict) else None
    return (
        value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else default
    )


def is_oom_message(message: str) -> bool:
    """ "out of memory", "out of device memory", "CUDA out of memory" and the like."""
    return _OOM.search(message) is not None


def _has_text(event: dict[str, Any]) -> bool:
    for choice in event.get("choices") or ():
        if not isinstance(choice, dict):
            continue
        if choice.get("text"):
            return True
        delta = choice.get("delta")
        if isinstance(delta, dict) and delta.get("content"):
            return True
    return False


def _message(body: Any) -> str | None:
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        error = body["error"]
        return str(error.get("message") or error.get("code") or "")
    return None


def _error_result(status: int, content: bytes) -> RequestResult:
    try:
        body = json.loads(content)
    except ValueError:
        body = None
    message = _message(body) or content[:200].decode(errors="replace")
    code = ""
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        code = str(body["error"].get("code") or "")
    oom = status == 503 and ("memory" in code.lower() or is_oom_message(message))
    return RequestResult(status=status, error=message[:200], oom=oom)
