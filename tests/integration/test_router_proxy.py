"""The router in front of two real simulated replicas: routing, streaming, SDK, ids, admin API."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.integration.router_helpers import replicas, wait_for
from tests.support import Proc, replica_process, router_process

SIM = "simulated:fixed_ms=0,prefill_ms=0,decode_ms=20"


@pytest.fixture(scope="module")
def fleet() -> Iterator[tuple[Proc, Proc, Proc]]:
    with (
        replica_process("--model", SIM, "--max-concurrency", "4", "--max-queue", "8") as a,
        replica_process("--model", SIM, "--max-concurrency", "4", "--max-queue", "8") as b,
        router_process(
            "--replica", f"a={a.url}", "--replica", f"b={b.url}", "--health-interval-s", "0.2"
        ) as router,
    ):
        yield a, b, router


def completion(url: str, max_tokens: int = 1, **extra: Any) -> httpx.Response:
    body = {"model": "simulated", "prompt": "hello", "max_tokens": max_tokens, **extra}
    return httpx.post(url + "/v1/completions", json=body, timeout=30)


def test_uneven_load_goes_to_the_least_loaded_replica(fleet: tuple[Proc, Proc, Proc]) -> None:
    a, _, router = fleet
    before = replicas(router.url)
    held = []  # keep the line iterators alive: dropping one closes its stream
    with httpx.Client(timeout=30) as client, contextlib.ExitStack() as stack:
        # Three long generations sent straight to replica a (not through the router).
        for _ in range(3):
            r = stack.enter_context(
                client.stream(
                    "POST",
                    a.url + "/v1/completions",
                    json={"prompt": "x", "max_tokens": 400, "stream": True},
                )
            )
            held.append(r.iter_lines())
            next(held[-1])
        wait_for(lambda: replicas(router.url)["a"]["reported_in_flight"] == 3)
        for _ in range(6):
            assert completion(router.url).status_code == 200
    after = replicas(router.url)
    assert after["b"]["picks"] - before["b"]["picks"] == 6
    assert after["a"]["picks"] == before["a"]["picks"]


def test_stream_reaches_the_client_while_the_replica_still_generates(
    fleet: tuple[Proc, Proc, Proc],
) -> None:
    a, b, router = fleet
    body = {"model": "simulated", "prompt": "hi", "max_tokens": 100, "stream": True}  # ~2 s
    with (
        httpx.Client(timeout=30) as client,
        client.stream("POST", router.url + "/v1/completions", json=body) as r,
    ):
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        assert json.loads(first[6:])["choices"][0]["text"]
        # The first token is here and the replica still has the request in flight.
        in_flight = sum(httpx.get(p.url + "/health").json()["in_flight"] for p in (a, b))
        assert in_flight == 1
        rest = [line for line in lines if line.startswith("data: ")]
    assert rest[-1] == "data: [DONE]"
    assert len(rest) >= 99


def test_openai_sdk_through_the_router(fleet: tuple[Proc, Proc, Proc]) -> None:
    openai = pytest.importorskip("openai")
    _, _, router = fleet
    client = openai.OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0)
    assert [m.id for m in client.models.list()] == ["simulated"]
    done = client.completions.create(model="simulated", prompt="hello", max_tokens=3)
    assert done.usage is not None and done.usage.completion_tokens == 3
    stream = client.chat.completions.create(
        model="simulated",
        messages=[{"role": "user", "content": "hello"}],
        max_tokens=4,
        stream=True,
    )
    pieces = [c.choices[0].delta.content or "" for c in stream if c.choices]
    assert "".join(pieces).strip()


def test_request_id_is_echoed_and_forwarded(fleet: tuple[Proc, Proc, Proc]) -> None:
    a, b, router = fleet
    r = httpx.post(
        router.url + "/generate",
        json={"text": "hi", "max_tokens": 1},
        headers={"X-Request-ID": "h3-trace-0042"},
    )
    assert r.status_code == 200
    assert r.headers["x-request-id"] == "h3-trace-0042"
    wait_for(lambda: "h3-trace-0042" in a.log() + b.log(), 5)
    fresh = httpx.post(router.url + "/generate", json={"text": "hi", "max_tokens": 1})
    assert len(fresh.headers["x-request-id"]) >= 16
    assert fresh.headers.get_list("x-request-id") == [fresh.headers["x-request-id"]]


def test_errors_are_json(fleet: tuple[Proc, Proc, Proc]) -> None:
    _, _, router = fleet
    missing = httpx.get(router.url + "/v2/nothing")
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found_error"
    wrong_method = httpx.get(router.url + "/v1/completions")
    assert wrong_method.status_code == 405 and "error" in wrong_method.json()
    # The replica's own 4xx passes through unchanged.
    bad, direct_bad = (
        httpx.post(
            url + "/v1/completions",
            content=b"{not json",
            headers={"content-type": "application/json"},
        )
        for url in (router.url, fleet[0].url)
    )
    assert bad.status_code == direct_bad.status_code == 400
    assert bad.json()["error"]["message"] == direct_bad.json()["error"]["message"]
    unknown = httpx.post(router.url + "/replicas/nope/drain")
    assert unknown.status_code == 404 and "nope" in unknown.json()["error"]["message"]
    # HEAD (curl -I) is forwarded; the replica's body-less answer ends at its head.
    before = replicas(router.url)
    head = httpx.head(router.url + "/v1/models", timeout=10)
    after = replicas(router.url)
    direct = httpx.head(fleet[0].url + "/v1/models", timeout=10)
    assert sum(after[n]["picks"] - before[n]["picks"] for n in ("a", "b")) == 1
    assert head.status_code == direct.status_code and head.content == b""
    assert head.headers.get("allow") == direct.headers.get("allow")  # the replica's own answer
    assert head.headers["content-length"] == direct.headers["content-length"] != "0"


def test_drained_replica_gets_no_work_and_comes_back(fleet: tuple[Proc, Proc, Proc]) -> None:
    _, _, router = fleet
    assert httpx.post(router.url + "/replicas/a/drain").json()["state"] == "drained"
    try:
        before = replicas(router.url)
        for _ in range(5):
            assert completion(router.url).status_code == 200
        after = replicas(router.url)
        assert after["a"]["picks"] == before["a"]["picks"]
        assert after["b"]["picks"] - before["b"]["picks"] == 5
    finally:
        assert httpx.post(router.url + "/replicas/a/undrain").json()["state"] == "ready"


def test_membership_changes_at_run_time(fleet: tuple[Proc, Proc, Proc]) -> None:
    _, b, router = fleet
    removed = httpx.delete(router.url + "/replicas/b")
    assert removed.status_code == 200
    try:
        assert set(replicas(router.url)) == {"a"}
        assert completion(router.url).status_code == 200
    finally:
        added = httpx.post(router.url + "/replicas", json={"url": b.url, "name": "b"})
    assert added.status_code == 201 and added.json()["state"] == "ready"
    assert set(replicas(router.url)) == {"a", "b"}
    again = httpx.post(router.url + "/replicas", json={"url": b.url, "name": "b2"})
    assert again.status_code == 409


def test_router_drain_refuses_new_work_and_finishes_in_flight(
    fleet: tuple[Proc, Proc, Proc],
) -> None:
    _, _, router = fleet
    body = {"model": "simulated", "prompt": "hi", "max_tokens": 150, "stream": True}  # ~3 s
    with (
        httpx.Client(timeout=30) as client,
        client.stream("POST", router.url + "/v1/completions", json=body) as r,
    ):
        lines = r.iter_lines()
        next(line for line in lines if line.startswith("data: "))
        try:
            assert httpx.post(router.url + "/admin/drain").json()["in_flight"] == 1
            refused = completion(router.url)
            assert refused.status_code == 503
            assert "draining" in refused.json()["error"]["message"]
            health = httpx.get(router.url + "/health")
            assert health.status_code == 503
            assert health.json()["draining"] is True and health.json()["in_flight"] == 1
            rest = [line for line in lines if line.startswith("data: ")]
        finally:
            httpx.post(router.url + "/admin/undrain")
    assert rest[-1] == "data: [DONE]"
    # The router counts the stream done just after its last byte: wait for it, not a race.
    wait_for(lambda: httpx.get(router.url + "/health").json()["in_flight"] == 0, 5)


def scrape(url: str) -> dict[str, float]:
    """``GET /metrics`` as {sample line without its value: value}."""
    text = httpx.get(url + "/metrics", timeout=5).text
    samples = (line.rsplit(" ", 1) for line in text.splitlines() if not line.startswith("#"))
    return {name: float(value) for name, value in samples}


def test_metrics_count_picks_and_requests(fleet: tuple[Proc, Proc, Proc]) -> None:
    _, _, router = fleet
    before = scrape(router.url)
    assert completion(router.url).status_code == 200
    after = scrape(router.url)

    def grew(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    picks = [f'gpupool_router_replica_picks_total{{replica="{n}"}}' for n in ("a", "b")]
    assert sorted(grew(p) for p in picks) == [0.0, 1.0]
    assert grew('gpupool_router_requests_total{status="200"}') == 1.0
    latency = [f'gpupool_router_upstream_latency_seconds_count{{replica="{n}"}}' for n in "ab"]
    assert sum(grew(c) for c in latency) == 1.0


def test_real_torch_replicas_behind_the_router() -> None:
    """Two builtin:tiny-random replicas (the real transformers engine) through the SDK."""
    openai = pytest.importorskip("openai")
    with (
        replica_process("--model", "builtin:tiny-random") as a,
        replica_process("--model", "builtin:tiny-random") as b,
        router_process(f"--replica=a={a.url}", f"--replica=b={b.url}") as router,
    ):
        client = openai.OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0)
        for _ in range(4):
            done = client.chat.completions.create(
                model="tiny-random",
                messages=[{"role": "user", "content": "hello"}],
                max_tokens=4,
            )
            assert done.usage is not None and done.usage.completion_tokens == 4
        chunks = list(
            client.completions.create(model="tiny-random", prompt="hi", max_tokens=3, stream=True)
        )
        assert sum(1 for c in chunks if c.choices and c.choices[0].text) >= 1
        state = replicas(router.url)
        assert state["a"]["picks"] + state["b"]["picks"] == 5
        assert state["a"]["model"] == state["b"]["model"] == "tiny-random"


def test_a_replica_that_reports_draining_takes_no_new_work(
    fleet: tuple[Proc, Proc, Proc],
) -> None:
    a, _, router = fleet
    assert httpx.post(a.url + "/admin/drain").status_code == 200
    try:
        wait_for(lambda: replicas(router.url)["a"]["state"] == "draining")
        before = replicas(router.url)
        for _ in range(5):
            assert completion(router.url).status_code == 200
        after = replicas(router.url)
        assert after["a"]["picks"] == before["a"]["picks"]
    finally:
        httpx.post(a.url + "/admin/undrain")
    wait_for(lambda: replicas(router.url)["a"]["state"] == "ready")
