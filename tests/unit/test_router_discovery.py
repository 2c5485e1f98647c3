"""DNS discovery, fake resolver: pods join, leave after their in-flight; hiccups change nothing."""

from __future__ import annotations

import asyncio
import contextlib
import socket

from common.config import DnsDiscovery
from router.discovery import DnsDiscoverer, replica_url, system_resolver
from router.pool import Pool, ReplicaState


class FakeResolver:
    def __init__(self) -> None:
        self.answer: list[str] | Exception = []
        self.calls: list[tuple[str, int]] = []

    async def __call__(self, name: str, port: int) -> list[str]:
        self.calls.append((name, port))
        if isinstance(self.answer, Exception):
            raise self.answer
        return list(self.answer)


def make() -> tuple[Pool, FakeResolver, DnsDiscoverer]:
    pool = Pool()
    resolver = FakeResolver()
    config = DnsDiscovery(name="replicas.gpupool.svc", port=9100, interval_s=1.0)
    return pool, resolver, DnsDiscoverer(pool, config, resolver)


async def test_addresses_join_and_leave() -> None:
    pool, resolver, disc = make()
    resolver.answer = ["10.0.0.1", "10.0.0.2"]
    await disc.refresh()
    assert resolver.calls == [("replicas.gpupool.svc", 9100)]
    assert sorted(r.url for r in pool.list()) == ["http://10.0.0.1:9100", "http://10.0.0.2:9100"]
    # New replicas are not ready until the poller has seen them.
    assert not any(r.ready for r in pool.list())

    resolver.answer = ["10.0.0.2", "10.0.0.3"]
    await disc.refresh()
    assert sorted(r.name for r in pool.list()) == ["10.0.0.2:9100", "10.0.0.3:9100"]


async def test_vanished_replica_finishes_its_in_flight_first() -> None:
    pool, resolver, disc = make()
    resolver.answer = ["10.0.0.1"]
    await disc.refresh()
    busy = pool.get("10.0.0.1:9100")
    assert busy is not None
    busy.in_flight = 2
    resolver.answer = []
    await disc.refresh()
    assert pool.get("10.0.0.1:9100") is busy and busy.removing and not busy.accepting
    busy.in_flight = 0
    await disc.refresh()
    assert len(pool) == 0


async def test_a_returning_address_is_taken_back() -> None:
    pool, resolver, disc = make()
    resolver.answer = ["10.0.0.1"]
    await disc.refresh()
    r = pool.get("10.0.0.1:9100")
    assert r is not None
    r.in_flight = 1
    resolver.answer = []
    await disc.refresh()
    resolver.answer = ["10.0.0.1"]
    await disc.refresh()
    assert pool.get("10.0.0.1:9100") is r and not r.removing


async def test_failed_lookup_keeps_the_pool() -> None:
    pool, resolver, disc = make()
    resolver.answer = ["10.0.0.1"]
    await disc.refresh()
    resolver.answer = socket.gaierror(-2, "Name or service not known")
    await disc.refresh()
    assert [r.name for r in pool.list()] == ["10.0.0.1:9100"]
    assert disc.last_error is not None and "replicas.gpupool.svc" in disc.last_error


async def test_a_name_that_cannot_be_resolved_at_all_is_a_failed_lookup() -> None:
    # A label over 63 characters fails in the IDNA codec, before any query: the router must
    # start (and keep running) with the error logged, not die with a traceback.
    pool = Pool()
    config = DnsDiscovery(name="a" * 70 + ".gpupool.svc", port=9100, interval_s=1.0)
    disc = DnsDiscoverer(pool, config, system_resolver)
    await disc.refresh()
    assert len(pool) == 0
    assert disc.last_error is not None and "a" * 70 in disc.last_error


async def test_replicas_it_did_not_add_are_left_alone() -> None:
    pool, resolver, disc = make()
    pool.add(ReplicaState(name="static", url="http://127.0.0.1:9999"))
    resolver.answer = ["10.0.0.1"]
    await disc.refresh()
    resolver.answer = []
    await disc.refresh()
    assert [r.name for r in pool.list()] == ["static"]


def test_ipv6_urls_are_bracketed() -> None:
    assert replica_url("fd00::5", 9100) == "http://[fd00::5]:9100"
    assert replica_url("10.1.2.3", 80) == "http://10.1.2.3:80"


async def test_discovery_outlives_an_unexpected_error() -> None:
    pool, resolver, _ = make()
    disc = DnsDiscoverer(pool, DnsDiscovery(name="r.svc", interval_s=0.01), resolver)
    resolver.answer = RuntimeError("a resolver bug")
    task = asyncio.create_task(disc.run())
    for _ in range(500):
        if len(resolver.calls) >= 2 or task.done():
            break
        await asyncio.sleep(0.01)
    resolver.answer = ["10.0.0.1"]
    for _ in range(500):
        if len(pool) or task.done():
            break
        await asyncio.sleep(0.01)
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    assert [r.name for r in pool.list()] == ["10.0.0.1:9100"]
