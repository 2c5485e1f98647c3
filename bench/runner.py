"""Run one level of a ladder: exactly N closed-loop clients sharing one ``httpx.AsyncClient``.

Each client sends a request, waits for the whole answer, and sends the next, until the level's
request budget is spent or its time is up (``duration_s``, and always the hard cap
``max_level_s``); requests already sent then finish, each bounded by the request timeout. A
client whose request was rejected (429) pauses ``reject_pause_s`` before its next one, so a
saturated server is not hammered in a busy loop. Memory is sampled in the background meanwhile.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import httpx

from bench import queue_wait
from bench.client import Clock, RequestSpec, send
from bench.memory import MemorySampler, discover
from bench.stats import LevelInput, LevelSummary, RequestResult, Slo, summarize
from bench.workload import Prompt

# Beyond the request timeout, how long a level may take to wind down before it is cut.
_GRACE_S = 5.0


@dataclass
class LevelPlan:
    spec: RequestSpec
    prompts: Sequence[Prompt]
    requests: int | None = 32  # per level; None: run for duration_s
    duration_s: float | None = None
    max_level_s: float = 300.0
    slo: Slo = field(default_factory=Slo)
    sample_interval_s: float = 0.1
    reject_pause_s: float = 0.1

    def __post_init__(self) -> None:
        if self.requests is None and self.duration_s is None:
            raise ValueError("a level needs a request count or a duration")
        if not self.prompts:
            raise ValueError("a level needs at least one prompt")


class PromptCycle:
    """Hands out prompts in order, round and round, across levels."""

    def __init__(self, prompts: Sequence[Prompt]) -> None:
        self._it: Iterator[Prompt] = itertools.cycle(prompts)

    def next(self) -> Prompt:
        return next(self._it)


def make_client(max_concurrency: int, timeout_s: float) -> httpx.AsyncClient:
    """One client for the whole ladder, with room for every concurrent request plus sampling."""
    size = max_concurrency + 8
    return httpx.AsyncClient(
        timeout=httpx.Timeout(timeout_s, connect=min(10.0, timeout_s)),
        limits=httpx.Limits(max_connections=size, max_keepalive_connections=size),
    )


async def run_level(
    client: httpx.AsyncClient,
    plan: LevelPlan,
    concurrency: int,
    prompts: PromptCycle,
    *,
    clock: Clock = time.perf_counter,
    on_result: Callable[[RequestResult], None] | None = None,
) -> LevelSummary:
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    results: list[RequestResult] = []
    started = 0
    headers = plan.spec.headers()
    target = await discover(client, plan.spec.base_url, headers)
    waits_before = await queue_wait.read_all(client, target.replicas, headers)
    start = clock()
    stop_at = start + min(plan.duration_s or plan.max_level_s, plan.max_level_s)
    cut = False
    last_done = start

    async def client_loop() -> None:
        nonlocal started, last_done
        while clock() < stop_at and (plan.requests is None or started < plan.requests):
            started += 1
            result = await send(client, plan.spec, prompts.next(), clock)
            results.append(result)
            last_done = clock()
            if on_result is not None:
                on_result(result)
            if result.rejected and plan.reject_pause_s > 0:
                await asyncio.sleep(plan.reject_pause_s)

    sampler = MemorySampler(client, target, interval_s=plan.sample_interval_s, headers=headers)
    stop = asyncio.Event()
    sampling = asyncio.create_task(sampler.run(stop))
    loops = [asyncio.create_task(client_loop()) for _ in range(concurrency)]
    limit = (stop_at - start) + plan.spec.timeout_s + _GRACE_S
    try:
        _, pending = await asyncio.wait(loops, timeout=limit)
        if pending:
            cut = True
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        for task in loops:
            if not task.cancelled() and task.exception() is not None:
                raise task.exception()  # type: ignore[misc]
    finally:
        # Up to the last answer: a client's pause after a final 429 is not load.
        duration = (last_done if results else clock()) - start
        stop.set()
        try:
            await asyncio.wait_for(sampling, timeout=5.0)
        except TimeoutError:
            sampling.cancel()
    waits_after = await queue_wait.read_all(client, target.replicas, headers)
    waits = queue_wait.level_percentiles(waits_before, waits_after)
    if plan.requests is not None and started < plan.requests:
        cut = True  # the hard time cap ended the level before its budget was spent
    return summarize(
        LevelInput(
            concurrency=concurrency,
            results=results,
            duration_s=duration,
            slo=plan.slo,
            memory=sampler.snapshot(),
            stopped_early=cut,
            queue_wait_from_metrics=waits,
        )
    )


async def discover_model(client: httpx.AsyncClient, spec: RequestSpec) -> str | None:
    """The first model id ``GET /v1/models`` lists, or None."""
    try:
        r = await client.get(spec.base_url.rstrip("/") + "/v1/models", headers=spec.headers())
        data = r.json().get("data") if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError, AttributeError):
        return None
    if isinstance(data, list) and data and isinstance(data[0], dict) and data[0].get("id"):
        return str(data[0]["id"])
    return None
