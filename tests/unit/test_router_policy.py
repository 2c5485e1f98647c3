"""Routing policy: least loaded wins, proportional to max_concurrency, full/low-memory skipped."""

from __future__ import annotations

import random
from collections import Counter

from common.protocol import HealthReport, MemoryInfo
from router.policy import Refusal, choose, refusal
from router.pool import Pool, ReplicaState

MB = 1024 * 1024


def replica(name: str, **kw: object) -> ReplicaState:
    r = ReplicaState(name=name, url=f"http://{name}", ready=True)
    for key, value in kw.items():
        setattr(r, key, value)
    return r


def test_lowest_load_wins() -> None:
    a = replica("a", max_concurrency=4, in_flight=3)
    b = replica("b", max_concurrency=4, in_flight=1)
    c = replica("c", max_concurrency=4, in_flight=2)
    assert choose([a, b, c], random.Random(0)) is b


def test_load_is_normalised_by_max_concurrency() -> None:
    # 3 in flight of 8 slots (0.375) is less loaded than 1 of 2 (0.5).
    big = replica("big", max_concurrency=8, in_flight=3)
    small = replica("small", max_concurrency=2, in_flight=1)
    assert choose([small, big], random.Random(0)) is big


def test_work_is_proportional_to_max_concurrency() -> None:
    # Send 60 requests that all stay in flight: the 4-slot replica takes twice the 2-slot's.
    a = replica("a", max_concurrency=4, max_queue=100)
    b = replica("b", max_concurrency=2, max_queue=100)
    rng = random.Random(1)
    picks: Counter[str] = Counter()
    for _ in range(60):
        chosen = choose([a, b], rng)
        assert chosen is not None
        chosen.in_flight += 1
        picks[chosen.name] += 1
    assert picks == {"a": 40, "b": 20}


def test_everything_full_is_all_full() -> None:
    a = replica("a", max_concurrency=4, max_queue=0, in_flight=4)
    b = replica("b", max_concurrency=2, max_queue=1, in_flight=3)
    assert choose([a, b], random.Random(0)) is None
    assert refusal([a, b]) is Refusal.ALL_FULL


def test_ties_are_broken_at_random() -> None:
    replicas = [replica(n) for n in "abc"]
    rng = random.Random(7)
    seen = Counter(choose(replicas, rng).name for _ in range(300))  # type: ignore[union-attr]
    assert set(seen) == {"a", "b", "c"}
    assert min(seen.values()) > 50


def test_not_ready_unhealthy_draining_and_drained_take_no_work() -> None:
    rng = random.Random(0)
    cases = [
        replica("loading", ready=False),
        replica("sick", healthy=False),
        replica("draining", draining=True),
        replica("drained", admin_drained=True),
        replica("leaving", removing=True),
    ]
    assert choose(cases, rng) is None
    assert refusal(cases) is Refusal.NONE_READY
    ok = replica("ok", in_flight=30, max_concurrency=1)
    assert choose([*cases, ok], rng) is ok


def test_full_replica_is_skipped_and_all_full_is_not_none_ready() -> None:
    full = replica("full", max_concurrency=1, max_queue=2, in_flight=3)
    assert choose([full], random.Random(0)) is None
    assert refusal([full]) is Refusal.ALL_FULL
    spare = replica("spare", max_concurrency=1, max_queue=2, in_flight=2)
    assert choose([full, spare], random.Random(0)) is spare


def test_low_free_memory_is_skipped_unknown_memory_is_not() -> None:
    tight = replica(
        "tight",
        memory=MemoryInfo(
            used_bytes=15 * 1024 * MB, total_bytes=16 * 1024 * MB, free_bytes=1024 * MB - 1
        ),
    )
    roomy = replica(
        "roomy",
        in_flight=5,
        max_concurrency=1,
        memory=MemoryInfo(used_bytes=0, total_bytes=16 * 1024 * MB, free_bytes=16 * 1024 * MB),
    )
    cpu = replica("cpu", in_flight=9, max_concurrency=1, memory=None)
    rng = random.Random(0)
    assert choose([tight, roomy], rng, min_free_memory_bytes=1024 * MB) is roomy
    assert choose([tight], rng, min_free_memory_bytes=1024 * MB) is None
    assert refusal([tight]) is Refusal.ALL_FULL
    assert choose([tight, cpu], rng, min_free_memory_bytes=1024 * MB) is cpu
    assert choose([tight], rng, min_free_memory_bytes=0) is tight


def test_exclude_skips_replicas_already_tried() -> None:
    a, b = replica("a"), replica("b", in_flight=5, max_concurrency=10)
    assert choose([a, b], random.Random(0), exclude=["a"]) is b
    assert choose([a, b], random.Random(0), exclude=["a", "b"]) is None


def _report(in_flight: int, queued: int) -> HealthReport:
    return HealthReport(
        ready=True,
        device="cpu",
        model="m",
        in_flight=in_flight,
        queued=queued,
        max_concurrency=2,
        max_queue=4,
    )


def test_merge_rule_counts_others_from_the_report_and_own_requests_live() -> None:
    r = replica("a")
    r.in_flight = 1  # the router's own, already at the replica when it reported
    r.apply_report(_report(in_flight=2, queued=1), now=0.0)  # 3 at the replica: 1 ours + 2 others
    assert r.outstanding == 3
    assert r.load == 1.5
    r.in_flight += 2  # two more sent before the next poll
    assert r.outstanding == 5
    r.in_flight -= 3  # all of ours finished; the others are still assumed there
    assert r.outstanding == 2
    # A report lower than our own count (ours not arrived yet) never makes load negative.
    r.in_flight = 4
    r.apply_report(_report(in_flight=1, queued=0), now=1.0)
    assert r.outstanding == 4


def test_report_updates_capacity_and_readiness() -> None:
    r = replica("a", max_concurrency=1, max_queue=32)
    r.apply_report(
        HealthReport(
            ready=False,
            device="cuda",
            model="m",
            in_flight=0,
            queued=0,
            max_concurrency=6,
            max_queue=3,
            draining=True,
        ),
        now=5.0,
    )
    assert (r.max_concurrency, r.max_queue, r.ready, r.draining) == (6, 3, False, True)
    assert r.state == "draining"


def test_pool_remove_waits_for_in_flight() -> None:
    pool = Pool()
    a = pool.add(replica("a", in_flight=1))
    pool.remove("a")
    assert pool.get("a") is a and a.removing
    assert choose(pool.list(), random.Random(0)) is None
    a.in_flight = 0
    pool.reap(a)
    assert pool.get("a") is None
