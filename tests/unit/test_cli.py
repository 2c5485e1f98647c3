"""`gpupool` as a user types it: pass-through help, clear refusals before anything starts."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import REPO, free_port


def gpupool(*args: str, state_dir: Path, timeout_s: float = 60) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "GPUPOOL_STATE_DIR": str(state_dir), "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, "-m", "deploy", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        stdin=subprocess.DEVNULL,
    )


def test_help_lists_every_command(tmp_path: Path) -> None:
    out = gpupool("--help", state_dir=tmp_path)
    assert out.returncode == 0
    # Each command starts a row of the commands table (the words alone also appear in the
    # descriptions: "One replica per GPU behind a least-loaded router. Start with: gpupool up").
    rows = [line.strip("│ ").split(" ", 1)[0] for line in out.stdout.splitlines()]
    for command in ("up", "status", "replica", "router", "ladder", "tune", "model"):
        assert command in rows, out.stdout


def test_replica_help_is_the_replicas_own_help(tmp_path: Path) -> None:
    out = gpupool("replica", "--help", state_dir=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "--max-concurrency" in out.stdout and "--replica" in out.stdout


def test_model_passes_its_arguments_through_unchanged(tmp_path: Path) -> None:
    missing = tmp_path / "nope.gguf"
    out = gpupool("model", "check", str(missing), state_dir=tmp_path)
    assert out.returncode != 0
    assert str(missing) in out.stdout + out.stderr


def test_bad_yaml_exits_2_naming_the_field_path_without_a_traceback(tmp_path: Path) -> None:
    config = tmp_path / "bad.yaml"
    config.write_text("replicas:\n  devices: [cpu]\n  max_queue: -3\nrouter:\n  prot: 1\n")
    out = gpupool("up", str(config), state_dir=tmp_path)
    assert out.returncode == 2
    text = out.stdout + out.stderr
    assert "replicas.max_queue: must be >= 0" in text
    assert "router.prot: unknown key" in text
    assert "Traceback" not in text


@pytest.mark.parametrize("bad", ["missing-model.gguf", "simulated:bogus=1"])
def test_a_bad_model_source_is_refused_before_anything_starts(tmp_path: Path, bad: str) -> None:
    config = tmp_path / "up.yaml"
    source = str(tmp_path / bad) if bad.endswith(".gguf") else bad
    config.write_text(
        f"model: {{source: '{source}'}}\n"
        f"replicas: {{devices: [cpu], port_base: {free_port()}}}\n"
        f"router: {{port: {free_port()}}}\n"
    )
    out = gpupool("up", str(config), state_dir=tmp_path)
    assert out.returncode == 2
    assert "model.source" in out.stdout and source in out.stdout
    assert not list(tmp_path.glob("logs-*"))  # no child was ever spawned


def test_a_port_in_use_is_named_and_nothing_starts(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        base = free_port()
        config = tmp_path / "up.yaml"
        config.write_text(
            "model: {source: 'simulated:decode_ms=0'}\n"
            f"replicas: {{devices: [cpu], port_base: {base}}}\n"
            f"router: {{port: {taken}}}\n"
        )
        out = gpupool("up", str(config), state_dir=tmp_path)
    assert out.returncode == 2
    assert f"port {taken} (router, 127.0.0.1): already in use" in out.stdout
    assert not list(tmp_path.glob("logs-*"))
    assert not list(tmp_path.glob("up-*.json"))


def test_a_state_dir_that_cannot_be_written_is_a_clear_error(tmp_path: Path) -> None:
    config = tmp_path / "up.yaml"
    config.write_text(
        "model: {source: simulated}\n"
        f"replicas: {{devices: [cpu], port_base: {free_port()}}}\n"
        f"router: {{port: {free_port()}}}\n"
    )
    (tmp_path / "a-file").write_text("")
    out = gpupool("up", str(config), state_dir=tmp_path / "a-file" / "state")
    assert out.returncode == 2
    assert "cannot write the state dir" in out.stdout and "GPUPOOL_STATE_DIR" in out.stdout
    assert "Traceback" not in out.stdout + out.stderr


def test_status_without_a_router_is_a_clear_error(tmp_path: Path) -> None:
    port = free_port()
    out = gpupool("status", "--url", f"http://127.0.0.1:{port}", state_dir=tmp_path)
    assert out.returncode == 1
    assert f"cannot reach the router at http://127.0.0.1:{port}" in out.stdout
    assert "Traceback" not in out.stdout + out.stderr


def test_devices_all_without_a_gpu_is_refused_clearly(tmp_path: Path) -> None:
    from common.gpu import list_gpus

    if list_gpus():
        pytest.skip("this machine has a GPU")
    config = tmp_path / "up.yaml"
    config.write_text(
        f"replicas: {{devices: all, port_base: {free_port()}}}\nrouter: {{port: {free_port()}}}\n"
    )
    out = gpupool("up", str(config), state_dir=tmp_path)
    assert out.returncode == 2
    assert 'replicas.devices: "all" but no GPU was found' in out.stdout
