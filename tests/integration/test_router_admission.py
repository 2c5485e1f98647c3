"""Admission and edges: fleet full -> 429, low memory, none ready -> 503, auth, foreign replicas,
--config, client disconnect cancels upstream."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.integration.router_helpers import replicas, wait_for
from tests.support import (
    Proc,
    free_port,
    python_module,
    replica_process,
    router_process,
    wait_http,
)

FAKES = "tests.integration.router_fakes"


@pytest.fixture(scope="module")
def single() -> Iterator[Proc]:
    """One slot, no queue, slow tokens: a single long stream fills it."""
    with replica_process(
        "--model", "simulated:decode_ms=20", "--max-concurrency", "1", "--max-queue", "0"
    ) as replica:
        yield replica


def test_fleet_full_gives_429_and_a_disconnect_cancels_upstream(single: Proc) -> None:
    with (
        router_process(f"--replica=one={single.url}", "--health-interval-s", "0.2") as router,
        httpx.Client(timeout=30) as client,
    ):
        body = {"model": "simulated", "prompt": "hi", "max_tokens": 500, "stream": True}
        with client.stream("POST", router.url + "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            next(line for line in lines if line.startswith("data: "))
            busy = client.post(router.url + "/generate", json={"text": "hi", "max_tokens": 1})
            assert busy.status_code == 429
            assert int(busy.headers["retry-after"]) >= 1
            assert busy.json()["error"]["type"] == "rate_limit_error"
        # The client went away ~10 s before the generation would end: the replica stops it.
        wait_for(lambda: httpx.get(single.url + "/health").json()["in_flight"] == 0, 8)
        wait_for(lambda: replicas(router.url)["one"]["load"] == 0)
        assert (
            client.post(router.url + "/generate", json={"text": "hi", "max_tokens": 1}).status_code
            == 200
        )
        metrics = client.get(router.url + "/metrics").text
        assert 'gpupool_router_rejections_total{reason="all_full"} 1.0' in metrics


def test_client_giving_up_on_a_plain_request_cancels_it_upstream(single: Proc) -> None:
    with router_process(f"--replica=one={single.url}") as router:
        body = {"model": "simulated", "prompt": "hi", "max_tokens": 500}  # ~10 s, not streamed
        with pytest.raises(httpx.ReadTimeout), httpx.Client(timeout=1.0) as client:
            client.post(router.url + "/v1/completions", json=body)
        wait_for(lambda: httpx.get(single.url + "/health").json()["in_flight"] == 0, 8)
        wait_for(lambda: httpx.get(router.url + "/health").json()["in_flight"] == 0, 5)
        assert "client disconnected" in router.log()


def test_sigterm_lets_a_running_stream_finish(single: Proc) -> None:
    with router_process(f"--replica=one={single.url}") as router:
        body = {"model": "simulated", "prompt": "hi", "max_tokens": 50, "stream": True}
        with (
            httpx.Client(timeout=30) as client,
            client.stream("POST", router.url + "/v1/completions", json=body) as r,
        ):
            lines = r.iter_lines()
            next(line for line in lines if line.startswith("data: "))
            router.popen.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]"
        # uvicorn re-raises the signal once it has shut down cleanly: -15, not a crash.
        assert router.popen.wait(15) in (0, -signal.SIGTERM)
        assert "Finished server process" in router.log()


def test_nearly_full_gpu_memory_gets_no_new_work() -> None:
    with (
        replica_process("--model", "simulated:weights_mb=16000,total_mb=16384") as tight,
        replica_process("--model", "simulated") as roomy,
        router_process(
            f"--replica=tight={tight.url}",
            f"--replica=roomy={roomy.url}",
            "--min-free-memory-mb",
            "1024",
        ) as router,
        httpx.Client(timeout=30) as client,
    ):
        statuses = [
            client.post(router.url + "/generate", json={"text": "hi", "max_tokens": 1}).status_code
            for _ in range(8)
        ]
        assert statuses == [200] * 8
        state = replicas(router.url)
        assert state["tight"]["picks"] == 0 and state["roomy"]["picks"] == 8
        assert state["tight"]["memory"]["free_bytes"] < 1024 * 1024 * 1024
        # With the roomy one drained, the tight one still takes nothing: 429, not a 500.
        client.post(router.url + "/replicas/roomy/drain")
        refused = client.post(router.url + "/generate", json={"text": "hi", "max_tokens": 1})
        assert refused.status_code == 429


def test_no_replica_ready_is_503_with_a_message() -> None:
    nobody = f"http://127.0.0.1:{free_port()}"
    with router_process(f"--replica=gone={nobody}", ready_path=None) as router:
        wait_http(router.url + "/health", 30, router, want=503)
        health = httpx.get(router.url + "/health").json()
        assert health["ready"] is False and health["ready_replicas"] == 0
        r = httpx.post(router.url + "/v1/completions", json={"prompt": "hi"})
        assert r.status_code == 503
        assert "no replica is ready" in r.json()["error"]["message"]


def test_auth_keys(single: Proc) -> None:
    env = {"GPUPOOL_API_KEYS": "sk-user-123", "GPUPOOL_ADMIN_KEYS": "sk-admin-456"}
    with router_process(f"--replica=one={single.url}", env=env) as router:
        url = router.url
        body = {"text": "hi", "max_tokens": 1}
        assert httpx.post(url + "/generate", json=body).status_code == 401
        wrong = httpx.post(url + "/generate", json=body, headers=_bearer("sk-nope"))
        assert wrong.status_code == 401
        assert wrong.json()["error"]["type"] == "authentication_error"
        assert httpx.post(url + "/generate", json=body, headers=_bearer("sk-user-123")).is_success
        assert httpx.get(url + "/v1/models").status_code == 401
        assert httpx.get(url + "/health").status_code == 200  # open to probes
        # Admin routes: the user key is not enough, the admin key is.
        assert httpx.get(url + "/replicas", headers=_bearer("sk-user-123")).status_code == 403
        assert httpx.post(url + "/admin/drain").status_code == 401
        drained = httpx.post(url + "/replicas/one/drain", headers=_bearer("sk-admin-456"))
        assert drained.status_code == 200 and drained.json()["state"] == "drained"
        undrained = httpx.post(url + "/replicas/one/undrain", headers=_bearer("sk-admin-456"))
        assert undrained.status_code == 200 and undrained.json()["state"] == "ready"
        assert "sk-user-123" not in router.log() and "sk-nope" not in router.log()


def test_foreign_replica_is_routed_on_the_routers_own_counts() -> None:
    port = free_port()
    with (
        python_module(FAKES, ["--port", str(port), "--mode", "foreign"], port=port) as foreign,
        router_process(f"--replica=vllm={foreign.url}") as router,
    ):
        r = httpx.post(router.url + "/v1/completions", json={"prompt": "hi"})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "foreign"
        state = replicas(router.url)["vllm"]
        assert state["foreign"] is True and state["state"] == "ready"
        assert httpx.get(foreign.url + "/count").json()["n"] == 1


def test_config_file_names_replicas_like_the_launcher(tmp_path: Path) -> None:
    port = free_port()
    with replica_process("--model", "simulated", port=port):
        config = tmp_path / "deploy.yaml"
        config.write_text(
            "model:\n  source: simulated\n"
            f"replicas:\n  devices: [cpu]\n  port_base: {port}\n"
            "router:\n  health_interval_s: 0.5\n"
        )
        with router_process("--config", str(config)) as router:
            state = replicas(router.url)
            assert list(state) == ["cpu0"] and state["cpu0"]["state"] == "ready"
            assert (
                httpx.post(
                    router.url + "/generate", json={"text": "hi", "max_tokens": 1}
                ).status_code
                == 200
            )


def test_bad_flags_fail_clearly(tmp_path: Path) -> None:
    import subprocess
    import sys

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "router", *args],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=Path(__file__).resolve().parents[2],
        )

    none = run("--port", "1")
    assert none.returncode == 2 and "no replicas" in none.stderr
    bad_url = run("--replica", "localhost:9100")
    assert bad_url.returncode == 2 and "http://" in bad_url.stderr
    missing = run("--config", str(tmp_path / "nope.yaml"))
    assert missing.returncode == 2 and "no such file" in missing.stderr
    assert "Traceback" not in none.stderr + bad_url.stderr + missing.stderr


def _bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}
