"""`python -m deploy.drain` (the preStop / ExecStop hook) against a real replica."""

from __future__ import annotations

import subprocess
import sys
import threading

import httpx

from tests.support import REPO, free_port, replica_process


def test_drain_turns_the_replica_away_from_new_work_and_waits_for_running_requests() -> None:
    with replica_process("--model", "simulated:fixed_ms=0,decode_ms=100", "--name", "d0") as rep:
        answers: list[int] = []

        def long_request() -> None:
            r = httpx.post(rep.url + "/generate", json={"text": "hi", "max_tokens": 20}, timeout=30)
            answers.append(r.status_code)

        worker = threading.Thread(target=long_request)
        worker.start()
        for _ in range(100):  # bounded: until the request is inside the replica
            if httpx.get(rep.url + "/health", timeout=5).json()["in_flight"] == 1:
                break
            threading.Event().wait(0.05)
        drained = subprocess.run(
            [sys.executable, "-m", "deploy.drain", rep.url, "--timeout-s", "30"],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=60,
        )
        # The drain returned only once the running request had completed, not before.
        health = httpx.get(rep.url + "/health", timeout=5)
        assert drained.returncode == 0, drained.stderr
        assert health.json()["completed"] == 1
        assert health.status_code == 503 and health.json()["draining"] is True
        worker.join(30)
        assert answers == [200]
        refused = httpx.post(rep.url + "/generate", json={"text": "hi", "max_tokens": 1})
        assert refused.status_code == 503


def test_drain_of_a_server_that_is_already_gone_succeeds() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    gone = subprocess.run(
        [sys.executable, "-m", "deploy.drain", url, "--timeout-s", "5"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert gone.returncode == 0
