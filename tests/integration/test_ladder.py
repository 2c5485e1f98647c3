"""`python -m bench.ladder` against a real replica running the simulated engine.

The replica admits 4 requests at once and queues 4 more; each request is 12 tokens of 5 ms.
Past 4 + 4 clients the replica refuses work (429s) and queued requests wait; the assertions are
on counts, and on latencies only where queueing makes them differ by whole generations.
"""

from __future__ import annotations

import csv
import json
import signal
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.integration.up_harness import wait_until
from tests.support import REPO, replica_process, router_process

SIMULATED = "simulated:decode_ms=5,prefill_ms=0"


def run_ladder(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "bench.ladder", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )


def by_level(path: Path) -> dict[int, dict[str, Any]]:
    data = json.loads((path / "results.json").read_text())
    return {lv["concurrency"]: lv for lv in data["levels"]}


def test_throughput_flattens_at_capacity_while_rejections_and_latency_grow(tmp_path: Path) -> None:
    with replica_process(
        "--model", SIMULATED, "--max-concurrency", "4", "--max-queue", "4", ready_timeout_s=60
    ) as replica:
        done = run_ladder(
            "--url", replica.url, "--levels", "1,4,16", "--requests-per-level", "48",
            "--max-tokens", "12", "--prompt-tokens", "16", "--stream",
            "--slo-e2e-ms", "10000", "--out", str(tmp_path),
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
    levels = by_level(tmp_path)
    one, four, sixteen = levels[1], levels[4], levels[16]
    figures = {c: (lv["request_rate"], lv["rejected"], lv["e2e_ms"]) for c, lv in levels.items()}
    # Throughput is answers per second of the level (no bound on the machine's speed: on a
    # busy machine 4 clients need not be 1.5 times as fast as 1).
    for lv in levels.values():
        assert lv["request_rate"] == pytest.approx(lv["ok"] / lv["duration_s"]), figures
        assert lv["ok"] + lv["rejected"] == lv["requests"] == 48, figures
    # Rejections only past concurrency + queue (4 + 4 < 16).
    assert one["rejected"] == 0 and four["rejected"] == 0, figures
    assert sixteen["rejected"] > 0, figures
    assert all(lv["failed"] == 0 for lv in levels.values()), levels
    # Waiting in the queue shows in latency and in the replica's own queue-wait histogram.
    assert sixteen["e2e_ms"]["p90"] > four["e2e_ms"]["p50"], figures
    assert sixteen["queue_wait_ms"]["mean"] > four["queue_wait_ms"]["mean"]
    assert sixteen["queue_wait_source"] == "metrics"
    # Token timing: 12 tokens per answer, 11 gaps each; generous SLO met by every admitted one.
    assert four["mean_output_tokens"] == 12
    assert four["itl_ms"]["count"] == 11 * four["ok"]
    assert four["goodput"] == 1.0 and sixteen["goodput"] < 1.0
    # Memory sampled from /health: the simulated weights (500 MiB) at least.
    assert all(lv["memory"]["replica"]["peak_used_mb"] >= 500 for lv in levels.values())


def test_files_are_written_and_agree(tmp_path: Path) -> None:
    with replica_process("--model", SIMULATED, "--max-concurrency", "2", ready_timeout_s=60) as r:
        done = run_ladder(
            "--url", r.url, "--levels", "1,2", "--requests-per-level", "6",
            "--max-tokens", "4", "--endpoint", "chat", "--out", str(tmp_path),
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
    levels = by_level(tmp_path)
    rows = list(csv.DictReader((tmp_path / "results.csv").open()))
    assert [int(r["concurrency"]) for r in rows] == sorted(levels) == [1, 2]
    for row in rows:
        lv = levels[int(row["concurrency"])]
        assert (int(row["requests"]), int(row["ok"]), int(row["rejected"])) == (
            lv["requests"],
            lv["ok"],
            lv["rejected"],
        )
        assert lv["requests"] == lv["ok"] == 6
    assert (tmp_path / "ladder.png").read_bytes()[:4] == b"\x89PNG"
    assert "conc" in done.stdout  # the final table


def test_duration_mode_runs_until_the_time_is_up(tmp_path: Path) -> None:
    with replica_process("--model", SIMULATED, "--max-concurrency", "2", ready_timeout_s=60) as r:
        done = run_ladder(
            "--url", r.url, "--levels", "2", "--duration-s", "0.5",
            "--max-tokens", "4", "--out", str(tmp_path),
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
    level = by_level(tmp_path)[2]
    assert level["ok"] >= 2 and level["failed"] == 0
    assert level["requests"] == level["ok"] + level["rejected"]
    # Clients keep sending until the time is up, so the last answer comes after it.
    assert level["duration_s"] >= 0.5 and not level["stopped_early"]


def test_the_hard_cap_ends_a_level_before_its_request_count(tmp_path: Path) -> None:
    with replica_process("--model", SIMULATED, "--max-concurrency", "1", ready_timeout_s=60) as r:
        # 1000 requests of 10 x 5 ms would need 50 s; the cap ends the level after 0.3 s.
        done = run_ladder(
            "--url", r.url, "--levels", "1", "--requests-per-level", "1000",
            "--max-level-s", "0.3", "--max-tokens", "10", "--out", str(tmp_path),
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
    level = by_level(tmp_path)[1]
    assert level["stopped_early"]
    assert 1 <= level["requests"] < 1000 and level["failed"] == 0


def test_through_a_router_memory_and_queue_wait_come_per_replica(tmp_path: Path) -> None:
    with (
        replica_process("--model", SIMULATED, "--max-concurrency", "2", ready_timeout_s=60) as a,
        replica_process("--model", SIMULATED, "--max-concurrency", "2", ready_timeout_s=60) as b,
        router_process("--replica", a.url, "--replica", b.url, ready_timeout_s=60) as router,
    ):
        wait_until_ready(router.url, replicas=2)
        done = run_ladder(
            "--url", router.url, "--levels", "1,4", "--requests-per-level", "16",
            "--max-tokens", "6", "--out", str(tmp_path),
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
    for level in by_level(tmp_path).values():
        assert level["ok"] == level["requests"] == 16
        assert len(level["memory"]) == 2  # one entry per replica, not the router
        assert all(m["peak_used_mb"] >= 500 for m in level["memory"].values())
        assert level["queue_wait_source"] == "metrics"
        assert level["queue_wait_ms"]["count"] == 16


def wait_until_ready(url: str, replicas: int) -> None:
    """Bounded: the router sees every replica ready within 20 s, or the test fails."""

    def ready() -> bool:
        body = httpx.get(url + "/health", timeout=2.0).json()
        return bool(body.get("ready_replicas") == replicas)

    wait_until(ready, 20, f"the router to see {replicas} ready replicas")


class StallingServer(ThreadingHTTPServer):
    """Answers the first ``answer`` completions at once, then holds every later one."""

    def __init__(self, answer: int) -> None:
        super().__init__(("127.0.0.1", 0), StallingHandler)
        self.answer = answer
        self.posts = 0
        self.stalled = threading.Event()
        self.release = threading.Event()


class StallingHandler(BaseHTTPRequestHandler):
    server: StallingServer

    def log_message(self, format: str, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        self.send_response(200 if self.path == "/health" else 404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        self.server.posts += 1
        if self.server.posts > self.server.answer:
            self.server.stalled.set()
            self.server.release.wait(30)
        body = json.dumps({"choices": [{"text": "x"}], "usage": {"completion_tokens": 1}})
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body.encode())


def test_ctrl_c_keeps_the_levels_that_finished(tmp_path: Path) -> None:
    server = StallingServer(answer=3)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    ladder = subprocess.Popen(
        [sys.executable, "-m", "bench.ladder", "--url", url, "--levels", "1,2",
         "--requests-per-level", "3", "--out", str(tmp_path)],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert server.stalled.wait(30), "the second level never started"
        ladder.send_signal(signal.SIGINT)
        _, err = ladder.communicate(timeout=30)
    finally:
        ladder.kill()
        server.release.set()
        server.shutdown()
        server.server_close()
    assert ladder.returncode == 130, err[-3000:]
    assert "Traceback" not in err and "interrupted" in err
    data = json.loads((tmp_path / "results.json").read_text())
    assert data["settings"]["interrupted"] is True
    assert [(lv["concurrency"], lv["ok"]) for lv in data["levels"]] == [(1, 3)]
    assert (tmp_path / "results.csv").read_text().count("\n") == 2
