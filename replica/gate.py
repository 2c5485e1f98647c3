"""Admission: at most ``max_concurrency`` requests inside the engine, a bounded FIFO queue.

- A free slot (and nobody waiting): admitted at once.
- Otherwise, room in the queue: wait in FIFO order, at most ``queue_timeout_s`` (then
  ``QueueTimeout``). A waiter that is cancelled (its client went away) leaves the queue and never
  runs.
- Queue full: ``QueueFull`` at once, with ``retry_after_s`` estimated from the recent completion
  rate (queued / rate, at least 1 s, at most the queue timeout).
- Draining: nothing new is admitted (``NotReady``); what is inside or queued goes on.

A slot is handed directly from a finishing request to the first waiter, so a newcomer can never
overtake the queue.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager, suppress

from replica.errors import NotReady, QueueFull, QueueTimeout

Clock = Callable[[], float]


class Slot:
    """One admitted request's place inside the engine; ``release()`` is idempotent."""

    def __init__(self, gate: Gate, queue_wait_s: float) -> None:
        self._gate = gate
        self.queue_wait_s = queue_wait_s
        self.released = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self._gate._release()


class Gate:
    def __init__(
        self,
        max_concurrency: int,
        max_queue: int,
        queue_timeout_s: float,
        clock: Clock = time.monotonic,
        rate_window_s: float = 60.0,
    ) -> None:
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
        if max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {max_queue}")
        self.max_concurrency = max_concurrency
        self.max_queue = max_queue
        self.queue_timeout_s = queue_timeout_s
        self._clock = clock
        self._rate_window_s = rate_window_s
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._completions: deque[float] = deque()
        self.in_flight = 0
        self.completed = 0
        self.draining = False

    @property
    def queued(self) -> int:
        return len(self._waiters)

    def drain(self) -> None:
        self.draining = True

    def undrain(self) -> None:
        self.draining = False

    def completion_rate(self) -> float:
        """Completions per second over the recent window (0 when none)."""
        now = self._clock()
        while self._completions and self._completions[0] < now - self._rate_window_s:
            self._completions.popleft()
        if not self._completions:
            return 0.0
        span = max(now - self._completions[0], 1e-3)
        return len(self._completions) / span

    def retry_after_s(self) -> int:
        cap = max(1, math.ceil(self.queue_timeout_s))
        rate = self.completion_rate()
        if rate <= 0:
            return 1
        return min(cap, max(1, math.ceil((self.queued + 1) / rate)))

    async def acquire(self) -> Slot:
        if self.draining:
            raise NotReady("replica is draining: not accepting new requests")
        if self.in_flight < self.max_concurrency and not self._waiters:
            self.in_flight += 1
            return Slot(self, 0.0)
        if len(self._waiters) >= self.max_queue:
            retry = self.retry_after_s()
            raise QueueFull(
                f"replica is busy: {self.in_flight} requests running and the queue is full "
                f"({self.queued}/{self.max_queue}); retry in {retry} s",
                retry_after_s=retry,
            )
        start = self._clock()
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            async with asyncio.timeout(self.queue_timeout_s):
                await waiter
        except BaseException as exc:
            handed_over = waiter.done() and not waiter.cancelled()
            if handed_over:
                self._pass_on()  # we were given a slot as we left: pass it on
            else:
                waiter.cancel()
                self._remove(waiter)
            if isinstance(exc, TimeoutError):
                raise QueueTimeout(
                    f"waited {self.queue_timeout_s:g} s in the queue without getting a slot "
                    f"(queue_timeout_s); the replica is overloaded"
                ) from exc
            raise
        return Slot(self, self._clock() - start)

    @asynccontextmanager
    async def admit(self) -> AsyncIterator[Slot]:
        slot = await self.acquire()
        try:
            yield slot
        finally:
            slot.release()

    def _remove(self, waiter: asyncio.Future[None]) -> None:
        with suppress(ValueError):
            self._waiters.remove(waiter)

    def _release(self) -> None:
        self.completed += 1
        self._completions.append(self._clock())
        self._pass_on()

    def _pass_on(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)  # the slot passes on; in_flight is unchanged
                return
        self.in_flight -= 1
