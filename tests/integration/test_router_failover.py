"""Failover with real processes: kill -9 under load, SIGSTOP/SIGCONT, a replica that answers 500,
a stream cut mid-way."""

from __future__ import annotations

import os
import signal
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx

from tests.integration.router_helpers import replicas, wait_for
from tests.support import free_port, python_module, replica_process, router_process

SIM = "simulated:fixed_ms=0,prefill_ms=0,decode_ms=10"
FAKES = "tests.integration.router_fakes"


def generate(client: httpx.Client, url: str, max_tokens: int = 1) -> int:
    r = client.post(url + "/generate", json={"text": "hi", "max_tokens": max_tokens})
    return r.status_code


def test_kill_9_under_load_loses_nothing_and_ejects_at_once() -> None:
    with (
        replica_process("--model", SIM, "--max-concurrency", "4") as a,
        replica_process("--model", SIM, "--max-concurrency", "4") as b,
        replica_process("--model", SIM, "--max-concurrency", "4") as c,
        # A poll interval far longer than the test: only passive detection can eject.
        router_process(
            *(f"--replica={n}={p.url}" for n, p in (("a", a), ("b", b), ("c", c))),
            "--health-interval-s",
            "600",
        ) as router,
    ):
        done = threading.Semaphore(0)
        statuses: list[int] = []

        def worker(n: int) -> None:
            with httpx.Client(timeout=30) as client:
                for _ in range(n):
                    statuses.append(generate(client, router.url, max_tokens=5))
                    done.release()

        with ThreadPoolExecutor(6) as pool:
            futures = [pool.submit(worker, 25) for _ in range(6)]
            for _ in range(30):
                assert done.acquire(timeout=30)
            os.kill(b.pid, signal.SIGKILL)
            for f in futures:
                f.result(timeout=120)
        assert len(statuses) == 150
        assert statuses.count(200) == 150, sorted(set(statuses))
        state = replicas(router.url)
        assert state["b"]["healthy"] is False
        assert state["b"]["ejections"] == 1
        # Not the poller: it never probed b after start-up.
        assert state["b"]["consecutive_failures"] == 0
        assert "failed" in state["b"]["last_error"]
        assert state["a"]["healthy"] and state["c"]["healthy"]
        metrics = httpx.get(router.url + "/metrics").text
        retried = [
            line
            for line in metrics.splitlines()
            if line.startswith('gpupool_router_retries_total{reason="connection"}')
        ]
        assert retried and float(retried[0].split()[-1]) >= 1


def test_sigstop_is_detected_by_the_probe_deadline_and_sigcont_brings_it_back() -> None:
    with (
        replica_process("--model", SIM) as a,
        replica_process("--model", SIM) as b,
        router_process(
            f"--replica=a={a.url}",
            f"--replica=b={b.url}",
            "--health-interval-s",
            "0.2",
            "--health-timeout-s",
            "0.5",
            "--fail-threshold",
            "2",
        ) as router,
    ):
        os.kill(a.pid, signal.SIGSTOP)
        try:
            wait_for(lambda: not replicas(router.url)["a"]["healthy"], 15)
            assert "timed out" in replicas(router.url)["a"]["last_error"]
            before = replicas(router.url)
            with httpx.Client(timeout=30) as client:
                assert [generate(client, router.url) for _ in range(6)] == [200] * 6
            after = replicas(router.url)
            assert after["a"]["picks"] == before["a"]["picks"]
            assert after["b"]["picks"] - before["b"]["picks"] == 6
        finally:
            os.kill(a.pid, signal.SIGCONT)
        wait_for(lambda: replicas(router.url)["a"]["healthy"], 15)
        before = replicas(router.url)
        with httpx.Client(timeout=30) as client:
            assert [generate(client, router.url) for _ in range(30)] == [200] * 30
        assert replicas(router.url)["a"]["picks"] > before["a"]["picks"]


def test_replica_answering_500_is_taken_out_of_rotation() -> None:
    port = free_port()
    with (
        python_module(FAKES, ["--port", str(port), "--mode", "error500"], port=port) as bad,
        replica_process("--model", SIM) as good,
        router_process(
            f"--replica=bad={bad.url}",
            f"--replica=good={good.url}",
            "--fail-threshold",
            "2",
            "--health-interval-s",
            "30",
        ) as router,
        httpx.Client(timeout=30) as client,
    ):
        statuses = [generate(client, router.url) for _ in range(30)]
        # /health of "bad" looks fine; its answers do not. Two 500s in a row take it out.
        assert statuses.count(500) == 2
        assert statuses.count(200) == 28
        assert httpx.get(bad.url + "/count").json()["n"] == 2
        state = replicas(router.url)["bad"]
        assert state["healthy"] is False and "consecutive 500" in state["last_error"]


def test_stream_cut_mid_way_ends_with_an_error_event() -> None:
    with (
        replica_process("--model", "simulated:decode_ms=20") as a,
        router_process(f"--replica=a={a.url}", "--health-interval-s", "600") as router,
        httpx.Client(timeout=30) as client,
    ):
        body = {"model": "simulated", "prompt": "hi", "max_tokens": 300, "stream": True}
        with client.stream("POST", router.url + "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            next(line for line in lines if line.startswith("data: "))
            os.kill(a.pid, signal.SIGKILL)
            rest = [line for line in lines if line.startswith("data: ")]
        assert rest, "the stream ended without a word"
        assert '"error"' in rest[-1] and "upstream_error" in rest[-1]
        assert "data: [DONE]" not in rest
        # The next request finds no replica: 503 with a message, not a hang or a 500.
        after = client.post(router.url + "/generate", json={"text": "hi"})
        assert after.status_code == 503
        assert "no replica is ready" in after.json()["error"]["message"]


def test_replica_429_is_retried_elsewhere_and_passed_through_when_alone() -> None:
    port = free_port()
    with (
        python_module(FAKES, ["--port", str(port), "--mode", "busy429"], port=port) as busy,
        replica_process("--model", SIM) as good,
        router_process(
            f"--replica=busy={busy.url}", f"--replica=good={good.url}", "--health-interval-s", "0.1"
        ) as router,
        httpx.Client(timeout=30) as client,
    ):
        # Until "busy" has been tried 3 times (a 429 makes it look full until the next poll,
        # and ties are broken at random), bounded in count: every answer must still be a 200.
        statuses = []
        for _ in range(300):
            statuses.append(generate(client, router.url))
            if httpx.get(busy.url + "/count").json()["n"] >= 3:
                break
        assert httpx.get(busy.url + "/count").json()["n"] >= 3, len(statuses)
        assert statuses == [200] * len(statuses)
        # Without another replica, the replica's own 429 (and its Retry-After) comes through.
        httpx.delete(router.url + "/replicas/good")
        wait_for(lambda: replicas(router.url)["busy"]["load"] == 0)  # a poll undid the last 429
        alone = client.post(router.url + "/generate", json={"text": "hi", "max_tokens": 1})
        assert alone.status_code == 429 and alone.headers["retry-after"] == "7"


def test_a_body_that_stalls_is_504_and_the_replica_sees_the_router_leave() -> None:
    port = free_port()
    with (
        python_module(FAKES, ["--port", str(port), "--mode", "stall"], port=port) as stall,
        router_process(f"--replica=s={stall.url}", "--request-timeout-s", "1") as router,
        httpx.Client(timeout=30) as client,
    ):
        r = client.post(router.url + "/generate", json={"text": "hi"})
        assert r.status_code == 504 and "did not answer" in r.json()["error"]["message"]
        # The connection to the replica is closed (a cancel there), not left open for ever.
        wait_for(lambda: httpx.get(stall.url + "/count").json()["gone"] == 1, 10)
