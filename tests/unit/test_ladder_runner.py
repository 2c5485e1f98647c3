"""bench.runner: a level is exactly N closed-loop clients and exactly its request budget."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from bench.client import RequestSpec
from bench.runner import LevelPlan, PromptCycle, run_level
from bench.workload import Prompt


class CountingServer:
    """Answers completions once ``hold`` requests are in flight together (or after 10 s)."""

    def __init__(self, hold: int) -> None:
        self.hold = hold
        self.in_flight = 0
        self.most = 0
        self.posts = 0
        self.full = asyncio.Event()

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.method != "POST":
            return httpx.Response(404)  # no /replicas, /health or /metrics: a plain server
        self.posts += 1
        self.in_flight += 1
        self.most = max(self.most, self.in_flight)
        if self.in_flight >= self.hold:
            self.full.set()
        try:
            await asyncio.wait_for(self.full.wait(), 10.0)
        except TimeoutError:
            pass
        finally:
            self.in_flight -= 1
        body = {"choices": [{"text": "x"}], "usage": {"prompt_tokens": 1, "completion_tokens": 1}}
        return httpx.Response(200, content=json.dumps(body).encode())


@pytest.mark.parametrize(("clients", "budget"), [(1, 3), (5, 23), (8, 8)])
async def test_a_level_runs_exactly_n_clients_and_its_request_budget(
    clients: int, budget: int
) -> None:
    server = CountingServer(hold=clients)
    spec = RequestSpec(
        base_url="http://r", endpoint="completions", model="m", max_tokens=1, stream=False
    )
    plan = LevelPlan(spec=spec, prompts=[Prompt(text="hi")], requests=budget)
    async with httpx.AsyncClient(transport=httpx.MockTransport(server)) as client:
        summary = await run_level(client, plan, clients, PromptCycle(plan.prompts))
    assert server.full.is_set()  # all N clients were in flight at once ...
    assert server.most == clients  # ... and never more
    assert server.posts == summary.requests == summary.ok == budget
    assert not summary.stopped_early
