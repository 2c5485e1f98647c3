"""Real ``python -m replica`` processes: the official openai SDK against them, the command's
flags and errors, --config/--replica, and a graceful SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from common.gpu import list_gpus
from tests.support import REPO, Proc, free_port, free_ports, replica_process


@pytest.fixture(scope="module")
def tiny() -> Iterator[Proc]:
    with replica_process("--model", "builtin:tiny-random", "--max-new-tokens", "64") as proc:
        yield proc


@pytest.fixture(scope="module")
def simulated() -> Iterator[Proc]:
    with replica_process("--model", "simulated:decode_ms=1", "--name", "sim0") as proc:
        yield proc


def sdk(proc: Proc) -> openai.OpenAI:
    return openai.OpenAI(base_url=proc.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.mark.parametrize("which", ["tiny", "simulated"])
def test_openai_sdk_chat_and_completions(which: str, request: pytest.FixtureRequest) -> None:
    proc: Proc = request.getfixturevalue(which)
    client = sdk(proc)
    model = client.models.list().data[0].id
    assert model == ("tiny-random" if which == "tiny" else "simulated")

    chat = client.chat.completions.create(
        model=model,
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        max_tokens=8,
        temperature=0,
    )
    assert chat.choices[0].message.role == "assistant"
    assert isinstance(chat.choices[0].message.content, str)
    assert chat.usage is not None
    assert chat.usage.prompt_tokens > 0
    assert 1 <= chat.usage.completion_tokens <= 8
    assert chat.usage.total_tokens == chat.usage.prompt_tokens + chat.usage.completion_tokens

    completion = client.completions.create(model=model, prompt="Once upon a time", max_tokens=6)
    assert completion.usage is not None
    assert 1 <= completion.usage.completion_tokens <= 6
    assert completion.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("which", ["tiny", "simulated"])
def test_openai_sdk_streams_with_usage(which: str, request: pytest.FixtureRequest) -> None:
    proc: Proc = request.getfixturevalue(which)
    client = sdk(proc)
    stream = client.chat.completions.create(
        model="any",
        messages=[{"role": "user", "content": "Tell me something"}],
        max_tokens=6,
        stream=True,
        stream_options={"include_usage": True},
        seed=1,
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    usage = chunks[-1].usage
    assert usage is not None
    assert 1 <= usage.completion_tokens <= 6
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")
    # Non-streamed with the same seed and prompt gives the same text (tiny-random's own
    # sampling, used when a request sets none, is greedy: the same as temperature 0).
    plain = client.chat.completions.create(
        model="any",
        messages=[{"role": "user", "content": "Tell me something"}],
        max_tokens=6,
        seed=1,
        temperature=0 if which == "tiny" else None,
    )
    assert plain.choices[0].message.content == text

    completion_chunks = list(
        client.completions.create(model="any", prompt="abc", max_tokens=4, stream=True)
    )
    assert completion_chunks[-1].choices[0].finish_reason in ("stop", "length")


def test_sdk_sees_our_error_message(simulated: Proc) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        sdk(simulated).completions.create(model="x", prompt="hi", max_tokens=100_000)
    assert "max_new_tokens" in str(info.value)


@pytest.mark.parametrize(
    ("payload", "status", "needle"),
    [
        ({"text": "hi", "max_tokens": 2, "seed": 10**23}, 422, "seed"),
        ({"text": "hi \ud800", "max_tokens": 2}, 400, "not valid Unicode"),
    ],
)
def test_input_the_torch_engine_would_choke_on_is_a_4xx(
    tiny: Proc, payload: dict[str, object], status: int, needle: str
) -> None:
    body = json.dumps(payload)  # escapes a lone surrogate, which httpx's json= refuses
    bad = httpx.post(tiny.url + "/generate", content=body, timeout=30)
    fine = httpx.post(tiny.url + "/generate", json={"text": "hi", "max_tokens": 2}, timeout=30)
    assert bad.status_code == status, bad.text
    assert needle in bad.json()["error"]["message"]
    assert fine.status_code == 200


def test_health_of_a_process(simulated: Proc) -> None:
    body = httpx.get(simulated.url + "/health", timeout=5).json()
    assert body["ready"] is True
    assert body["model"] == "simulated"
    assert body["memory"]["total_bytes"] == 16384 * 1024 * 1024
    assert body["memory"]["used_bytes"] >= 500 * 1024 * 1024


def run_main(
    *args: str, timeout: float = 60, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "replica", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
        env=None if env is None else {**os.environ, **env},
    )


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--model", "simulated:warp=9"], "unknown option 'warp'"),
        (["--model", "simulated", "--device", "tpu"], "device must be cpu, cuda or cuda:N"),
        (["--model", "simulated", "--max-queue", "-1"], "max_queue"),
        (["--model", "simulated", "--request-timeout-s", "inf"], "request_timeout_s: must be"),
        (["--model", "simulated", "--queue-timeout-s", "1e309"], "queue_timeout_s: must be"),
        ([], "give --model SOURCE"),
        (["--config", "/nonexistent/deploy.yaml"], "no such file"),
        (["--model", "simulated", "--replica", "cpu0"], "--replica needs --config"),
    ],
)
def test_bad_flags_are_one_line_and_exit_2(args: list[str], needle: str) -> None:
    done = run_main(*args, "--port", str(free_port()))
    assert done.returncode == 2
    assert needle in done.stderr
    assert "Traceback" not in done.stderr


def test_a_cuda_ordinal_hidden_by_cuda_visible_devices_is_one_line_and_exit_2() -> None:
    done = run_main(
        "--model",
        "builtin:tiny-random",
        "--device",
        "cuda:1",
        "--port",
        str(free_port()),
        env={"CUDA_VISIBLE_DEVICES": "0"},
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert "cuda:1 is not visible with CUDA_VISIBLE_DEVICES='0'" in done.stderr
    assert "Traceback" not in done.stderr


def test_unparseable_flag_exits_2() -> None:
    done = run_main("--model", "simulated", "--port", "many")
    assert done.returncode == 2
    assert "--port" in done.stderr


def test_missing_model_source_fails_at_start_and_exits_non_zero(tmp_path: Path) -> None:
    done = run_main(
        "--model", str(tmp_path / "nothing-here"), "--port", str(free_port()), timeout=120
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert "nothing-here" in done.stderr
    assert "Traceback" not in done.stderr


def test_config_and_replica_name_with_flag_override(tmp_path: Path) -> None:
    base = free_ports(2)
    config = tmp_path / "deploy.yaml"
    config.write_text(
        "model:\n  source: simulated:decode_ms=0\n  max_new_tokens: 7\n"
        f"replicas:\n  devices: [cpu, cpu]\n  port_base: {base}\n  max_concurrency: 3\n"
        "  max_queue: 5\n"
        f"router:\n  port: {free_port()}\n"
    )
    unknown = run_main("--config", str(config), "--replica", "gpu9")
    assert unknown.returncode == 2
    assert "no such replica" in unknown.stderr and "cpu0, cpu1" in unknown.stderr
    port = free_port()
    with replica_process(
        "--config", str(config), "--replica", "cpu1", "--max-queue", "9", port=port
    ) as proc:
        health = httpx.get(proc.url + "/health", timeout=5).json()
        too_many = httpx.post(proc.url + "/generate", json={"text": "a", "max_tokens": 8})
    assert (health["max_concurrency"], health["max_queue"]) == (3, 9)
    assert too_many.status_code == 400
    assert "limit of 7" in too_many.json()["error"]["message"]


def test_a_router_only_config_has_no_replica_to_run(tmp_path: Path) -> None:
    config = tmp_path / "router-only.yaml"
    config.write_text(
        "model:\n  source: simulated\nreplicas:\n  devices: []\n"
        "remote_replicas:\n  - url: http://127.0.0.1:9\n"
    )
    for args in ([], ["--replica", "cpu0"]):
        done = run_main("--config", str(config), *args)
        assert done.returncode == 2
        assert "has no local replica to run (replicas.devices is empty" in done.stderr


def test_devices_all_without_a_gpu_is_a_clean_error(tmp_path: Path) -> None:
    if list_gpus():
        pytest.skip("NVML sees a GPU here")
    config = tmp_path / "all.yaml"
    config.write_text("model:\n  source: simulated\nreplicas:\n  devices: all\n")
    done = run_main("--config", str(config), "--replica", "gpu0")
    assert done.returncode == 2
    assert "no GPU was found" in done.stderr
    assert "Traceback" not in done.stderr


def test_sigterm_lets_the_in_flight_request_finish() -> None:
    with replica_process("--model", "simulated:decode_ms=50,prefill_ms=0") as proc:
        result: dict[str, httpx.Response] = {}

        def call() -> None:
            result["r"] = httpx.post(
                proc.url + "/generate", json={"text": "a", "max_tokens": 20}, timeout=30
            )

        thread = threading.Thread(target=call)
        thread.start()
        wait_until_in_flight(proc)
        proc.popen.send_signal(signal.SIGTERM)
        thread.join(30)
        # uvicorn re-raises the captured SIGTERM after its graceful shutdown.
        assert proc.popen.wait(30) in (0, -signal.SIGTERM)
    assert result["r"].status_code == 200
    assert result["r"].json()["usage"]["completion_tokens"] == 20
    assert "Shutting down" in proc.log()


def wait_until_in_flight(proc: Proc) -> None:
    for _ in range(200):
        if httpx.get(proc.url + "/health", timeout=5).json()["in_flight"] == 1:
            return
        threading.Event().wait(0.02)
    raise AssertionError("request never got in flight")
