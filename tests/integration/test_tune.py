"""`python -m bench.tune` against replicas running the simulated engine.

Memory case: a 1000 MiB simulated GPU with 500 MiB of weights and 600 KiB of KV per token, and
100 MiB of headroom. A request holds its ~90 prompt tokens plus up to 10 generated ones, so 4 at
once use <= 734 MiB, while 8 at once use >= 922 MiB: above total - headroom (900 MiB) but under
the total, so the step fails on memory (not OOM). The answer must be 4.

OOM case: the same GPU with 700 MiB in all and no headroom: 3 requests of <= 100 tokens fit
(<= 676 MiB) but a 4th prompt of 90 tokens does not, so the simulated engine answers "out of
device memory" at 4 clients. The answer must be 2.

SLO case: knee=2 makes every decode step slower beyond 2 requests in flight (10 ms, 20 ms at 4,
40 ms at 8); a 30 ms TPOT objective then holds up to 4 clients and fails at 8.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.support import REPO, replica_process

CONFIG = """\
# A simulated GPU for tune tests.
model:
  source: "simulated:decode_ms=5,prefill_ms=0,weights_mb=500,kv_kb_per_token=600,total_mb=1000"
  max_new_tokens: 64   # short answers

replicas:
  devices: [cpu]
  # raised by measurement
  max_concurrency: 1   # tune me
  max_queue: 16
  headroom_mb: 100

router:
  port: 8000
"""


def run_tune(*args: str, tmpdir: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "TMPDIR": str(tmpdir)} if tmpdir else None
    return subprocess.run(
        [sys.executable, "-m", "bench.tune", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )


def test_tune_stops_at_the_memory_limit_and_writes_back(tmp_path: Path) -> None:
    config = tmp_path / "sim.yaml"
    config.write_text(CONFIG)
    done = run_tune(
        str(config), "--prompt-tokens", "90", "--max-tokens", "10", "--up-to", "32",
        "--write", "--out", str(tmp_path / "out"),
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert "recommended max_concurrency: 4" in done.stdout
    report = json.loads((tmp_path / "out" / "tune.json").read_text())
    steps = report["steps"]
    assert [s["concurrency"] for s in steps] == [1, 2, 4, 8]  # stopped at the first bad step
    assert [s["problem"] is None for s in steps] == [True, True, True, False]
    assert "memory" in steps[-1]["problem"] and steps[-1]["summary"]["oom"] == 0
    assert report["recommended"] == 4
    before, after = CONFIG.splitlines(), config.read_text().splitlines()
    changed = [(a, b) for a, b in zip(before, after, strict=True) if a != b]
    assert changed == [("  max_concurrency: 1   # tune me", "  max_concurrency: 4   # tune me")]


def test_tune_stops_at_the_first_out_of_memory_answer(tmp_path: Path) -> None:
    config = tmp_path / "oom.yaml"
    logs = tmp_path / "tmp"
    logs.mkdir()
    config.write_text(
        CONFIG.replace("total_mb=1000", "total_mb=700").replace(
            "headroom_mb: 100", "headroom_mb: 0"
        )
    )
    done = run_tune(
        str(config), "--prompt-tokens", "90", "--max-tokens", "10", "--up-to", "32",
        "--out", str(tmp_path / "out"), tmpdir=logs,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert "recommended max_concurrency: 2" in done.stdout
    assert not list(logs.iterdir())  # each step's replica log is gone with its replica
    assert "no SLO given" in done.stderr
    steps = json.loads((tmp_path / "out" / "tune.json").read_text())["steps"]
    assert [s["concurrency"] for s in steps] == [1, 2, 4]
    assert steps[-1]["summary"]["oom"] > 0 and "out of memory" in steps[-1]["problem"]
    assert [s["summary"]["oom"] for s in steps[:2]] == [0, 0]


def test_tune_against_a_url_stops_at_a_missed_slo(tmp_path: Path) -> None:
    model = "simulated:decode_ms=10,prefill_ms=0,knee=2"
    with replica_process(
        "--model", model, "--max-concurrency", "64", ready_timeout_s=60
    ) as replica:
        done = run_tune(
            "--url", replica.url, "--stream", "--slo-tpot-ms", "30", "--max-tokens", "10",
            "--prompt-tokens", "8", "--up-to", "16", "--out", str(tmp_path),
        )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert "recommended client concurrency: 4" in done.stdout
    assert "step client concurrency=1" in done.stderr
    assert "no SLO given" not in done.stderr
    steps = json.loads((tmp_path / "tune.json").read_text())["steps"]
    assert [s["concurrency"] for s in steps] == [1, 2, 4, 8]
    assert "missed SLO" in steps[-1]["problem"]


def test_tune_against_a_url_stops_when_the_server_rejects_load(tmp_path: Path) -> None:
    # One slot, no queue: a second client gets 429s. No SLO is given; the 429s alone decide.
    with replica_process(
        "--model",
        "simulated:decode_ms=5,prefill_ms=0",
        "--max-concurrency",
        "1",
        "--max-queue",
        "0",
        ready_timeout_s=60,
    ) as replica:
        done = run_tune(
            "--url", replica.url, "--max-tokens", "10", "--prompt-tokens", "8", "--up-to", "8",
            "--out", str(tmp_path),
        )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert "recommended client concurrency: 1" in done.stdout
    steps = json.loads((tmp_path / "tune.json").read_text())["steps"]
    assert [s["concurrency"] for s in steps] == [1, 2]
    assert "429" in steps[-1]["problem"]


def test_tune_reports_a_replica_that_cannot_start(tmp_path: Path) -> None:
    config = tmp_path / "bad.yaml"
    config.write_text(CONFIG.replace("decode_ms=5", "bogus=1"))
    done = run_tune(str(config), "--up-to", "2", "--ready-timeout-s", "60")
    assert done.returncode == 1
    assert "exited" in done.stderr and "bogus" in done.stderr
    assert config.read_text() == CONFIG.replace("decode_ms=5", "bogus=1")


def children_of(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def test_ctrl_c_stops_the_step_replica_and_exits_130(tmp_path: Path) -> None:
    config = tmp_path / "slow.yaml"
    config.write_text(CONFIG.replace("decode_ms=5", "decode_ms=200"))
    tune = subprocess.Popen(
        [sys.executable, "-m", "bench.tune", str(config), "--requests-per-level", "50"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        replicas: list[int] = []
        for _ in range(300):  # bounded: the step's replica appears within 30 s
            replicas = children_of(tune.pid)
            if replicas:
                break
            time.sleep(0.1)
        assert replicas, "tune never started a replica"
        tune.send_signal(signal.SIGINT)
        _, err = tune.communicate(timeout=60)
    finally:
        tune.kill()
        tune.wait(10)
    assert tune.returncode == 130, err[-3000:]
    assert "Traceback" not in err and "interrupted" in err
    assert not any(Path(f"/proc/{pid}").exists() for pid in replicas)
    assert config.read_text() == CONFIG.replace("decode_ms=5", "decode_ms=200")
