"""Active health checks: GET /health of every replica, concurrently, with a deadline.

Rules:

- A probe fails on a connection error, on the deadline (a hung replica that accepts but never
  answers), or on an answer that is neither 200 nor a gpupool report (a 500, a 404...).
- ``fail_threshold`` failures in a row mark a replica unhealthy; ``success_threshold``
  successes in a row mark it healthy again (after any 5xx ejection back-off has passed).
- A gpupool ``HealthReport`` (200, or 503 while loading/draining) is a success, and its ready,
  draining, load and memory are taken as reported.
- Any other 200 (vLLM answers an empty 200) is a *foreign* replica: ready, routed on the
  router's own counts, with a configured max_concurrency.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections import deque
from collections.abc import Callable

import httpx
from pydantic import ValidationError

from common.protocol import HealthReport
from router.pool import Pool, ReplicaState

log = logging.getLogger("gpupool.router.health")

Clock = Callable[[], float]


class CompletionRate:
    """Requests finished per second over a sliding window, for Retry-After."""

    def __init__(self, clock: Clock, window_s: float = 10.0) -> None:
        self._clock = clock
        self._window_s = window_s
        # (second, count) buckets, oldest first.
        self._buckets: deque[list[int]] = deque()

    def record(self, n: int = 1) -> None:
        second = int(self._clock())
        if self._buckets and self._buckets[-1][0] == second:
            self._buckets[-1][1] += n
        else:
            self._buckets.append([second, n])
            self._trim(second)

    def _trim(self, second: int) -> None:
        while self._buckets and self._buckets[0][0] <= second - self._window_s:
            self._buckets.popleft()

    def per_second(self) -> float:
        now = self._clock()
        self._trim(int(now))
        total = sum(count for _, count in self._buckets)
        return total / self._window_s

    def retry_after_s(self, waiting: int, unknown_s: int = 5, cap_s: int = 60) -> int:
        """Seconds until roughly ``waiting`` requests have finished (at least 1)."""
        rate = self.per_second()
        if rate <= 0:
            return unknown_s
        return max(1, min(cap_s, math.ceil(max(waiting, 1) / rate)))


class HealthPoller:
    def __init__(
        self,
        pool: Pool,
        client: httpx.AsyncClient,
        *,
        interval_s: float,
        timeout_s: float,
        fail_threshold: int,
        success_threshold: int,
        foreign_max_concurrency: int,
        foreign_max_queue: int,
        clock: Clock,
    ) -> None:
        self.pool = pool
        self.client = client
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.fail_threshold = fail_threshold
        self.success_threshold = success_threshold
        self.foreign_max_concurrency = foreign_max_concurrency
        self.foreign_max_queue = foreign_max_queue
        self.clock = clock

    async def run(self) -> None:
        """Probe every replica each interval, forever (the lifespan cancels it)."""
        while True:
            started = self.clock()
            try:
                await self.poll_once()
            except Exception:  # a bug in one probe must not end health checks for good
                log.exception("health poll failed; polling goes on")
            elapsed = self.clock() - started
            await asyncio.sleep(max(self.interval_s - elapsed, 0.01))

    async def poll_once(self) -> None:
        replicas = self.pool.list()
        if replicas:
            await asyncio.gather(*(self.probe(r) for r in replicas))

    async def probe(self, replica: ReplicaState) -> None:
        try:
            async with asyncio.timeout(self.timeout_s):
                response = await self.client.get(replica.url + "/health", timeout=self.timeout_s)
        except (httpx.HTTPError, httpx.InvalidURL, TimeoutError, OSError) as exc:
            # InvalidURL: a URL that got past the checks must not stop the poller for all.
            self.failure(replica, _describe(exc))
            return
        report = _parse_report(response)
        now = self.clock()
        if report is not None:
            replica.apply_report(report, now)
            if response.status_code != 200 and report.status == "failed":
                self.failure(replica, f"replica failed: {report.error or 'no detail'}")
                return
            self.success(replica)
        elif response.status_code == 200:
            replica.apply_foreign(now, self.foreign_max_concurrency, self.foreign_max_queue)
            self.success(replica)
        else:
            self.failure(replica, f"/health answered {response.status_code}")

    def success(self, replica: ReplicaState) -> None:
        replica.consecutive_failures = 0
        replica.consecutive_successes += 1
        if (
            not replica.healthy
            and replica.consecutive_successes >= self.success_threshold
            and self.clock() >= replica.ejected_until
        ):
            replica.healthy = True
            log.info("replica %s healthy again", replica.name)

    def failure(self, replica: ReplicaState, reason: str) -> None:
        replica.consecutive_successes = 0
        replica.consecutive_failures += 1
        replica.last_error = reason
        if replica.healthy and replica.consecutive_failures >= self.fail_threshold:
            replica.healthy = False
            replica.ejections += 1
            log.warning(
                "replica %s unhealthy after %d failed probes: %s",
                replica.name,
                replica.consecutive_failures,
                reason,
            )


def _parse_report(response: httpx.Response) -> HealthReport | None:
    if response.status_code not in (200, 503):
        return None
    with contextlib.suppress(ValueError, ValidationError):
        return HealthReport.model_validate_json(response.content)
    return None


def _describe(exc: BaseException) -> str:
    if isinstance(exc, (TimeoutError, httpx.TimeoutException)):
        return "health probe timed out"
    text = str(exc) or type(exc).__name__
    return f"health probe failed: {text}"
