"""`python -m deploy.drain` (the preStop / ExecStop hook) against a real replica."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import httpx

from tests.support import REPO, free_port, replica_process, router_process


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
        else:
            raise AssertionError("the request never got inside the replica")
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


def deploy(module: str, *args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """``python -m module args`` with only the GPUPOOL_ variables given in ``env``."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("GPUPOOL_")}
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=REPO,
        env={**clean, **env, "COLUMNS": "200"},
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_drain_and_status_use_the_admin_key_from_the_environment() -> None:
    keys = {"GPUPOOL_API_KEYS": "user-key", "GPUPOOL_ADMIN_KEYS": "admin-key, second"}
    with (
        replica_process("--model", "simulated:decode_ms=0", "--name", "k0") as rep,
        router_process("--replica", f"k0={rep.url}", env=keys) as router,
    ):
        refused = deploy("deploy", "status", "--url", router.url, env={})
        assert refused.returncode == 1 and "answered 401" in refused.stdout
        shown = deploy("deploy", "status", "--url", router.url, env=keys)
        assert shown.returncode == 0 and "k0" in shown.stdout, shown.stdout

        assert deploy("deploy.drain", router.url, "--timeout-s", "10", env={}).returncode == 2
        assert httpx.get(router.url + "/health", timeout=5).json()["draining"] is False
        drained = deploy("deploy.drain", router.url, "--timeout-s", "10", env=keys)
        assert drained.returncode == 0, drained.stderr
        assert httpx.get(router.url + "/health", timeout=5).json()["draining"] is True


def test_drain_reads_the_key_variables_the_config_names() -> None:
    # router.admin_keys_env: OPS_KEYS; the hook is told the same name.
    with (
        replica_process("--model", "simulated:decode_ms=0", "--name", "k0") as rep,
        router_process(
            "--replica", f"k0={rep.url}", "--admin-keys-env", "OPS_KEYS", env={"OPS_KEYS": "ops"}
        ) as router,
    ):
        hook = ("deploy.drain", router.url, "--timeout-s", "10")
        assert deploy(*hook, env={"OPS_KEYS": "ops"}).returncode == 2  # default names: no key
        drained = deploy(*hook, "--admin-keys-env", "OPS_KEYS", env={"OPS_KEYS": "ops"})
        assert drained.returncode == 0, drained.stderr
        assert httpx.get(router.url + "/health", timeout=5).json()["draining"] is True
