"""`gpupool up` as real processes on loopback: serve, restart, drain, leave no child behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import yaml

from tests.integration.up_harness import alive, gpupool_up, processes_mentioning, wait_until
from tests.support import REPO, free_port, free_ports


def write_config(tmp_path: Path, source: str, devices: str, **replicas: object) -> Path:
    base = free_ports(len(yaml.safe_load(devices)))
    extra = "".join(f"  {k}: {v}\n" for k, v in replicas.items())
    path = tmp_path / "up.yaml"
    path.write_text(
        f"model:\n  source: '{source}'\n  max_new_tokens: 32\n"
        f"replicas:\n  devices: {devices}\n  port_base: {base}\n  ready_timeout_s: 120\n{extra}"
        f"router:\n  port: {free_port()}\n  health_interval_s: 0.2\n  drain_timeout_s: 20\n"
    )
    return path


def router_states(url: str) -> list[str]:
    body = httpx.get(url + "/replicas", timeout=5).json()
    items = body["replicas"] if isinstance(body, dict) else body
    return [str(r["state"]) for r in items]


def generate(url: str, max_tokens: int = 2, timeout_s: float = 30) -> int:
    body = {"text": "hello", "max_tokens": max_tokens}
    r = httpx.post(url + "/generate", json=body, timeout=timeout_s)
    return r.status_code


def test_simulated_fleet_serves_restarts_a_killed_replica_and_drains_on_sigterm(
    tmp_path: Path,
) -> None:
    config = write_config(
        tmp_path, "simulated:fixed_ms=100,decode_ms=100", "[cpu, cpu]", max_concurrency=4
    )
    with gpupool_up(tmp_path, config) as up:
        assert [generate(up.url) for _ in range(4)] == [200] * 4

        status = subprocess.run(
            [sys.executable, "-m", "deploy", "status", "--url", up.url],
            cwd=REPO,
            env={**up.env, "COLUMNS": "200"},
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert status.returncode == 0, status.stdout + status.stderr
        # A row per replica: name, state, ..., restarts (0 from this launcher's state, not "-").
        lines = status.stdout.replace("┃", "│").splitlines()  # the header's bars are heavy
        table = {
            cells[0]: cells
            for line in lines
            if line.count("│") > 2
            for cells in [[c.strip() for c in line.split("│")[1:-1]]]
        }
        assert "restarts" in table["replica"], status.stdout
        for name in ("cpu0", "cpu1"):
            assert table[name][1] == "ready", status.stdout
            assert table[name][table["replica"].index("restarts")] == "0", status.stdout

        # kill -9 one replica: requests sent during the outage succeed on the other one.
        victim = up.child("cpu1")["pid"]
        os.kill(victim, signal.SIGKILL)
        assert [generate(up.url) for _ in range(6)] == [200] * 6
        up.wait_restarted("cpu1", victim, 60)
        assert up.child("cpu1")["restarts"] == 1
        wait_until(
            lambda: router_states(up.url) == ["ready", "ready"],
            30,
            "the router to see both replicas ready",
        )

        # A second `up` on the same ports is refused and disturbs nothing.
        second = subprocess.run(
            [sys.executable, "-m", "deploy", "up", str(config)],
            cwd=REPO,
            env=up.env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert second.returncode == 2
        assert "already running on router port" in second.stdout
        assert generate(up.url) == 200

        # The router is restarted too when it dies.
        router = up.child("router")["pid"]
        os.kill(router, signal.SIGKILL)
        up.wait_restarted("router", router, 60)
        assert generate(up.url) == 200

        # SIGTERM while requests run: every one is answered, then nothing is left.
        children = up.pids()
        results: list[int] = []
        threads = [
            threading.Thread(
                target=lambda: results.append(generate(up.url, max_tokens=30, timeout_s=60))
            )
            for _ in range(6)
        ]
        for t in threads:
            t.start()
        wait_until(
            lambda: httpx.get(up.url + "/health", timeout=5).json().get("in_flight", 0) == 6,
            20,
            "all six requests in flight at the router",
        )
        up.popen.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(60)
        assert results == [200] * 6
        assert up.popen.wait(60) == 0
        wait_until(lambda: not any(alive(p) for p in children), 10, "no child left")
        # Nothing at all runs from this deployment's files any more (children, grandchildren).
        assert processes_mentioning(str(up.state_dir)) == []
        assert not list(up.state_dir.glob("up-*.json"))


def test_tiny_model_fleet_answers_and_kill_9_of_the_launcher_leaves_no_child(
    tmp_path: Path,
) -> None:
    config = write_config(tmp_path, "builtin:tiny-random", "[cpu]")
    with gpupool_up(tmp_path, config) as up:
        r = httpx.post(
            up.url + "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
            timeout=60,
        )
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["role"] == "assistant"
        children = up.pids()
        assert len(children) == 2  # one replica, the router
        assert sorted(processes_mentioning(str(up.state_dir))) == sorted(children)
        up.popen.kill()
        up.popen.wait(10)
        wait_until(lambda: not any(alive(p) for p in children), 15, "no orphan after kill -9")
        assert processes_mentioning(str(up.state_dir)) == []
