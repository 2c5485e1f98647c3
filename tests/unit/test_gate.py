"""Gate semantics, counted: concurrency bound, FIFO, queue full, queue timeout, cancel, drain."""

from __future__ import annotations

import asyncio
import random

import pytest

from replica.errors import NotReady, QueueFull, QueueTimeout
from replica.gate import Gate, Slot


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def settle(rounds: int = 5) -> None:
    """Let every ready task run a few steps (no wall-clock waiting)."""
    for _ in range(rounds):
        await asyncio.sleep(0)


async def test_never_more_than_max_concurrency_inside_under_60_requests() -> None:
    gate = Gate(max_concurrency=3, max_queue=100, queue_timeout_s=30)
    inside = 0
    most = 0
    done = 0
    rng = random.Random(7)

    async def request() -> None:
        nonlocal inside, most, done
        async with gate.admit():
            inside += 1
            most = max(most, inside)
            for _ in range(rng.randint(1, 4)):
                await asyncio.sleep(0)
            inside -= 1
        done += 1

    await asyncio.wait_for(asyncio.gather(*(request() for _ in range(60))), 10)
    assert most == 3
    assert done == 60
    assert gate.completed == 60
    assert (gate.in_flight, gate.queued) == (0, 0)


async def test_waiters_are_admitted_in_arrival_order() -> None:
    gate = Gate(max_concurrency=1, max_queue=10, queue_timeout_s=30)
    first = await gate.acquire()
    order: list[int] = []
    slots: list[Slot] = []

    async def wait(i: int) -> None:
        slot = await gate.acquire()
        order.append(i)
        slots.append(slot)

    tasks = [asyncio.create_task(wait(i)) for i in range(5)]
    await settle()
    assert gate.queued == 5
    first.release()
    for _ in range(5):
        await settle()
        slots[-1].release()
    await asyncio.wait_for(asyncio.gather(*tasks), 5)
    assert order == [0, 1, 2, 3, 4]
    assert (gate.in_flight, gate.queued) == (0, 0)


async def test_newcomer_does_not_overtake_the_queue() -> None:
    gate = Gate(max_concurrency=1, max_queue=10, queue_timeout_s=30)
    first = await gate.acquire()
    waiter = asyncio.create_task(gate.acquire())
    await settle()
    first.release()  # the slot goes to the waiter, not to whoever calls next
    late = asyncio.create_task(gate.acquire())
    await settle()
    assert waiter.done() and not late.done()
    waiter.result().release()
    await settle()
    assert late.done()
    late.result().release()
    assert gate.in_flight == 0


async def test_queue_full_is_immediate_with_retry_after_from_completion_rate() -> None:
    clock = FakeClock()
    gate = Gate(max_concurrency=1, max_queue=2, queue_timeout_s=60, clock=clock)
    # 4 completions over 2 seconds: 2 per second.
    for _ in range(4):
        slot = await gate.acquire()
        clock.now += 0.5
        slot.release()
    running = await gate.acquire()
    waiters = [asyncio.create_task(gate.acquire()) for _ in range(2)]
    await settle()
    with pytest.raises(QueueFull) as info:
        await gate.acquire()
    # (2 queued + this one) / rate 2 per second -> 2 s
    assert info.value.retry_after_s == 2
    assert "queue is full (2/2)" in info.value.message
    running.release()
    for w in waiters:
        await settle()
        w.result().release()
    assert (gate.in_flight, gate.queued) == (0, 0)


async def test_retry_after_is_at_least_one_second_and_at_most_the_queue_timeout() -> None:
    clock = FakeClock()
    gate = Gate(max_concurrency=1, max_queue=0, queue_timeout_s=5, clock=clock)
    running = await gate.acquire()
    with pytest.raises(QueueFull) as no_history:
        await gate.acquire()
    assert no_history.value.retry_after_s == 1
    running.release()
    clock.now += 50  # one completion, long ago: a very slow rate
    running = await gate.acquire()
    with pytest.raises(QueueFull) as slow:
        await gate.acquire()
    assert slow.value.retry_after_s == 5
    running.release()


async def test_queue_timeout_raises_and_leaves_the_queue() -> None:
    gate = Gate(max_concurrency=1, max_queue=5, queue_timeout_s=0.05)
    running = await gate.acquire()
    with pytest.raises(QueueTimeout) as info:
        await gate.acquire()
    assert "waited 0.05 s in the queue" in info.value.message
    assert gate.queued == 0
    running.release()
    assert gate.in_flight == 0


async def test_cancelled_waiter_never_gets_a_slot() -> None:
    gate = Gate(max_concurrency=1, max_queue=5, queue_timeout_s=30)
    running = await gate.acquire()
    gone = asyncio.create_task(gate.acquire())
    stays = asyncio.create_task(gate.acquire())
    await settle()
    gone.cancel()
    await settle()
    assert gate.queued == 1
    running.release()
    await settle()
    assert gone.cancelled()
    assert stays.done()
    stays.result().release()
    assert (gate.in_flight, gate.queued) == (0, 0)


async def test_waiter_cancelled_just_as_it_was_given_a_slot_passes_it_on() -> None:
    gate = Gate(max_concurrency=1, max_queue=5, queue_timeout_s=30)
    running = await gate.acquire()
    waiter = asyncio.create_task(gate.acquire())
    await settle()
    running.release()  # hands the slot to the waiter's future...
    waiter.cancel()  # ...which is cancelled before it runs
    await settle()
    assert waiter.cancelled()
    assert (gate.in_flight, gate.queued) == (0, 0)
    slot = await asyncio.wait_for(gate.acquire(), 1)
    slot.release()


async def test_release_is_idempotent() -> None:
    gate = Gate(max_concurrency=2, max_queue=0, queue_timeout_s=1)
    a = await gate.acquire()
    b = await gate.acquire()
    a.release()
    a.release()
    assert gate.in_flight == 1
    b.release()
    assert gate.in_flight == 0
    assert gate.completed == 2


async def test_drain_refuses_new_work_but_lets_queued_finish() -> None:
    gate = Gate(max_concurrency=1, max_queue=5, queue_timeout_s=30)
    running = await gate.acquire()
    queued = asyncio.create_task(gate.acquire())
    await settle()
    gate.drain()
    with pytest.raises(NotReady, match="draining"):
        await gate.acquire()
    running.release()
    await settle()
    queued.result().release()
    gate.undrain()
    slot = await gate.acquire()
    slot.release()
    assert gate.completed == 3


def test_bad_limits_are_refused() -> None:
    with pytest.raises(ValueError, match="max_concurrency"):
        Gate(max_concurrency=0, max_queue=1, queue_timeout_s=1)
    with pytest.raises(ValueError, match="max_queue"):
        Gate(max_concurrency=1, max_queue=-1, queue_timeout_s=1)
