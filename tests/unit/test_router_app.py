"""The router app in-process, its replicas played by an httpx transport, on a fake clock:
the rules that need exact control of time and of replica answers."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable

import httpx
import pytest
from fastapi import FastAPI

from common.config import RouterConfig
from router.app import create_app
from router.health import HealthPoller
from router.pool import Pool, ReplicaState
from router.settings import ReplicaSpec, RouterSettings


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def report(**kw: object) -> dict[str, object]:
    base: dict[str, object] = {
        "ready": True,
        "device": "cpu",
        "model": "m",
        "in_flight": 0,
        "queued": 0,
        "max_concurrency": 2,
        "max_queue": 2,
    }
    return {**base, **kw}


Behaviour = Callable[[httpx.Request], httpx.Response]


class Replicas:
    """Per host: what /health and the work routes answer; counts the work requests."""

    def __init__(self, **work: Behaviour) -> None:
        self.work = work
        self.calls: Counter[str] = Counter()

    def __call__(self, request: httpx.Request) -> httpx.Response:
        host = request.url.host
        if request.url.path == "/health":
            return httpx.Response(200, json=report())
        self.calls[host] += 1
        return self.work[host](request)


def ok(request: httpx.Request) -> httpx.Response:
    return httpx.Response(200, json={"result": "fine"})


def boom(request: httpx.Request) -> httpx.Response:
    return httpx.Response(500, json={"error": {"message": "boom", "type": "server_error"}})


def refuse(request: httpx.Request) -> httpx.Response:
    raise httpx.ConnectError("connection refused", request=request)


async def running(
    replicas: Replicas, clock: FakeClock, **router: object
) -> AsyncIterator[tuple[FastAPI, httpx.AsyncClient]]:
    settings = RouterSettings(
        router=RouterConfig.model_validate({"health_interval_s": 3600, **router}),
        replicas=[ReplicaSpec(name=h, url=f"http://{h}:9100") for h in replicas.work],
    )
    upstream = httpx.AsyncClient(transport=httpx.MockTransport(replicas))
    app = create_app(settings, client=upstream, clock=clock, env={})
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://router") as c,
    ):
        yield app, c
    await upstream.aclose()


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


async def generate(c: httpx.AsyncClient) -> httpx.Response:
    return await c.post("/generate", json={"text": "hi"})


async def test_fleet_wide_outage_is_bounded_and_then_refused_at_once(clock: FakeClock) -> None:
    replicas = Replicas(a=refuse, b=refuse, c=refuse, d=refuse)
    async for _, c in running(replicas, clock, max_attempts=3):
        first = await generate(c)
        assert first.status_code == 503
        assert "no replica is ready" in first.json()["error"]["message"]
        assert sum(replicas.calls.values()) == 3  # max_attempts, not one per replica
        second = await generate(c)
        assert second.status_code == 503
        assert sum(replicas.calls.values()) == 4  # the one replica not yet tried
        third = await generate(c)
        assert third.status_code == 503 and sum(replicas.calls.values()) == 4
        states = (await c.get("/replicas")).json()["replicas"]
        assert [r["state"] for r in states] == ["unhealthy"] * 4
        assert all(r["ejections"] == 1 for r in states)


async def test_5xx_ejection_backs_off_and_a_relapse_ejects_again(clock: FakeClock) -> None:
    replicas = Replicas(bad=boom, good=ok)
    async for app, c in running(replicas, clock, fail_threshold=2, health_interval_s=1.0):
        pool, poller = app.state.pool, app.state.poller
        bad = pool.get("bad")
        statuses = [(await generate(c)).status_code for _ in range(20)]
        assert statuses.count(500) == 2 and not bad.healthy
        # /health looks fine, but the back-off (1 s) has not passed: still out.
        await poller.probe(bad)
        assert not bad.healthy
        clock.now += 1.5
        await poller.probe(bad)
        assert bad.healthy
        # One more 500 after readmission ejects it again, for twice as long.
        for _ in range(200):  # bounded: ties are broken at random, so "bad" comes up soon
            if replicas.calls["bad"] > 2:
                break
            await generate(c)
        assert replicas.calls["bad"] == 3
        assert not bad.healthy and bad.ejected_until == pytest.approx(clock.now + 2.0)
        assert bad.ejections == 2


async def test_request_body_and_id_reach_the_replica(clock: FakeClock) -> None:
    seen: list[httpx.Request] = []

    def record(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, json={"echo": json.loads(request.content)})

    async for _, c in running(Replicas(a=record), clock):
        r = await c.post(
            "/v1/completions?trace=1",
            json={"prompt": "hi"},
            headers={"X-Request-ID": "abc.123", "Authorization": "Bearer not-for-replicas"},
        )
    assert r.status_code == 200 and r.json() == {"echo": {"prompt": "hi"}}
    assert r.headers["x-request-id"] == "abc.123"
    assert seen[0].url.path == "/v1/completions" and seen[0].url.query == b"trace=1"
    assert seen[0].headers["x-request-id"] == "abc.123"
    assert "authorization" not in seen[0].headers


async def test_invalid_request_id_is_replaced(clock: FakeClock) -> None:
    seen: list[httpx.Request] = []

    def record(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return ok(request)

    async for _, c in running(Replicas(a=record), clock):
        r = await generate_with_id(c, "bad id with spaces")
    assert r.headers["x-request-id"] != "bad id with spaces"
    assert len(r.headers["x-request-id"]) == 32
    # The replica gets the id the client got back (and logs it), not the malformed one.
    assert seen[0].headers.get_list("x-request-id") == [r.headers["x-request-id"]]


async def generate_with_id(c: httpx.AsyncClient, request_id: str) -> httpx.Response:
    return await c.post("/generate", json={"text": "hi"}, headers={"X-Request-ID": request_id})


async def test_dns_discovery_feeds_the_pool(clock: FakeClock) -> None:
    answers = [["10.0.0.7", "10.0.0.8"]]

    async def resolver(name: str, port: int) -> list[str]:
        assert (name, port) == ("replicas.gpupool.svc", 9100)
        return answers[-1]

    replicas = Replicas(**{"10.0.0.7": ok, "10.0.0.8": ok})
    settings = RouterSettings(
        router=RouterConfig.model_validate(
            {
                "health_interval_s": 3600,
                "discovery": {"name": "replicas.gpupool.svc", "port": 9100, "interval_s": 3600},
            }
        )
    )
    upstream = httpx.AsyncClient(transport=httpx.MockTransport(replicas))
    app = create_app(settings, client=upstream, clock=clock, resolver=resolver, env={})
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://router") as c,
    ):
        # Discovered at start-up and probed before the first request.
        assert (await c.get("/health")).json()["ready_replicas"] == 2
        for _ in range(4):
            assert (await generate(c)).status_code == 200
        assert sum(replicas.calls.values()) == 4
        assert set(replicas.calls) <= {"10.0.0.7", "10.0.0.8"}
        answers.append(["10.0.0.8"])
        await app.state.discoverer.refresh()
        names = [r["name"] for r in (await c.get("/replicas")).json()["replicas"]]
        assert names == ["10.0.0.8:9100"]
    await upstream.aclose()


async def test_oversized_body_is_413_before_any_replica_sees_it(clock: FakeClock) -> None:
    replicas = Replicas(a=ok)
    settings = RouterSettings(
        router=RouterConfig(health_interval_s=3600),
        replicas=[ReplicaSpec(name="a", url="http://a:9100")],
        max_body_bytes=1024,
    )
    upstream = httpx.AsyncClient(transport=httpx.MockTransport(replicas))
    app = create_app(settings, client=upstream, clock=clock, env={})
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://router") as c,
    ):
        r = await c.post("/v1/completions", json={"prompt": "x" * 2000})
        assert r.status_code == 413 and "1024 bytes" in r.json()["error"]["message"]
        bad = await c.post("/replicas", json={"url": "localhost:9100"})
        assert bad.status_code == 400 and "http://" in bad.json()["error"]["message"]
        missing = await c.post("/replicas", json={})
        assert missing.status_code == 422 and "url" in missing.json()["error"]["message"]
    assert replicas.calls == {}
    await upstream.aclose()


async def test_slow_replica_is_504(clock: FakeClock) -> None:
    def slow(request: httpx.Request) -> httpx.Response:
        raise httpx.ReadTimeout("no data", request=request)

    async for _, c in running(Replicas(a=slow), clock, request_timeout_s=7):
        r = await generate(c)
    assert r.status_code == 504
    assert r.json()["error"]["type"] == "timeout_error" and "7s" in r.json()["error"]["message"]


class _BreaksMidway(httpx.AsyncByteStream):
    async def __aiter__(self) -> AsyncIterator[bytes]:
        yield b'data: {"choices": [{"text": "one"}]}\n\n'
        raise httpx.ReadError("connection reset by peer")


async def test_stream_cut_ends_with_an_error_event_not_done(clock: FakeClock) -> None:
    def cut(request: httpx.Request) -> httpx.Response:
        return httpx.Response(
            200, headers={"content-type": "text/event-stream"}, stream=_BreaksMidway()
        )

    async for app, c in running(Replicas(a=cut), clock):
        r = await c.post("/v1/completions", json={"prompt": "hi", "stream": True})
        replica = app.state.pool.get("a")
    events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert json.loads(events[0]) == {"choices": [{"text": "one"}]}
    error = json.loads(events[-1])["error"]
    assert error["type"] == "upstream_error" and "connection reset" in error["message"]
    assert "[DONE]" not in r.text
    assert replica.in_flight == 0 and replica.errors >= 1


async def test_a_failed_attempt_with_nothing_else_ready_is_503_not_429(clock: FakeClock) -> None:
    def reset(request: httpx.Request) -> httpx.Response:
        raise httpx.RemoteProtocolError("server disconnected", request=request)

    async for app, c in running(Replicas(a=reset), clock):
        r = await generate(c)
        replica = app.state.pool.get("a")
    assert r.status_code == 503
    assert "server disconnected" in r.json()["error"]["message"]
    # A reset on a kept-alive connection alone does not eject (it may be a keep-alive race).
    assert replica.healthy and replica.errors == 1 and replica.in_flight == 0


async def test_a_malformed_replica_url_is_400_and_never_stops_the_poller(
    clock: FakeClock,
) -> None:
    async for app, c in running(Replicas(a=ok), clock):
        bad = await c.post("/replicas", json={"url": "http://[::1", "name": "v6"})
        assert bad.status_code == 400 and "not a valid URL" in bad.json()["error"]["message"]
        for body, problem in (([1], "request body: "), ({}, "url: Field required")):
            wrong = await c.post("/replicas", json=body)
            assert wrong.status_code == 422 and problem in wrong.json()["error"]["message"]
        assert [r["name"] for r in (await c.get("/replicas")).json()["replicas"]] == ["a"]
        # Should one get in anyway, its probes fail; the other replicas are still probed.
        pool = app.state.pool
        pool.add(ReplicaState(name="v6", url="http://[::1"))
        a = pool.get("a")
        a.ready = False
        await app.state.poller.poll_once()
        assert a.ready and pool.get("v6").last_error.startswith("health probe failed")


async def test_the_poller_outlives_an_unexpected_error() -> None:
    probed: Counter[str] = Counter()

    def answer(request: httpx.Request) -> httpx.Response:
        probed[request.url.host] += 1
        if request.url.host == "odd":
            raise ValueError("a bug somewhere below the probe")
        return httpx.Response(200, json=report())

    pool = Pool()
    for name in ("odd", "fine"):
        pool.add(ReplicaState(name=name, url=f"http://{name}:9100"))
    async with httpx.AsyncClient(transport=httpx.MockTransport(answer)) as client:
        poller = HealthPoller(
            pool,
            client,
            interval_s=0.01,
            timeout_s=1.0,
            fail_threshold=1,
            success_threshold=1,
            foreign_max_concurrency=1,
            foreign_max_queue=1,
            clock=time.monotonic,
        )
        task = asyncio.create_task(poller.run())
        for _ in range(500):
            if probed["fine"] >= 3 or task.done():
                break
            await asyncio.sleep(0.01)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    assert probed["fine"] >= 3


async def test_retries_stop_when_the_budget_is_spent(clock: FakeClock) -> None:
    # "a" resets every connection (retried elsewhere, not ejected); the clock stands still,
    # so the budget holds its initial 10 tokens plus 0.2 per request, and no more.
    def reset(request: httpx.Request) -> httpx.Response:
        raise httpx.ReadError("connection reset", request=request)

    replicas = Replicas(a=reset, b=ok)
    settings = RouterSettings(
        router=RouterConfig.model_validate({"health_interval_s": 3600, "retry_budget_ratio": 0.2}),
        replicas=[ReplicaSpec(name=h, url=f"http://{h}:9100") for h in replicas.work],
    )
    upstream = httpx.AsyncClient(transport=httpx.MockTransport(replicas))
    app = create_app(settings, client=upstream, clock=clock, env={}, rng=random.Random(3))
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://router") as c,
    ):
        statuses = Counter([(await generate(c)).status_code for _ in range(100)])
        metrics = (await c.get("/metrics")).text
    await upstream.aclose()
    # Every 200 came from b; every attempt at a was either retried on b or ended in a 503.
    assert replicas.calls["b"] == statuses[200] and statuses[200] + statuses[503] == 100
    retried = replicas.calls["a"] - statuses[503]
    assert 10 + 20 - 1 <= retried <= 10 + 20  # the reserve, then 0.2 per request
    assert statuses[503] > 0
    assert 'gpupool_router_rejections_total{reason="retry_budget"} ' in metrics
