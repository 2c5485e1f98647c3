"""The systemd unit templates: one replica per GPU, drained before they are stopped."""

from __future__ import annotations

import configparser
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SYSTEMD = Path(__file__).resolve().parents[2] / "deploy" / "systemd"


def unit(name: str) -> configparser.RawConfigParser:
    parser = configparser.RawConfigParser(strict=False, interpolation=None)
    parser.optionxform = str  # type: ignore[assignment,method-assign]
    parser.read_string((SYSTEMD / name).read_text())
    return parser


def drain_timeout(exec_stop: str) -> float:
    words = exec_stop.split()
    assert words[1:4] == ["-m", "deploy.drain", words[3]] and words[3].startswith("http://")
    return float(words[words.index("--timeout-s") + 1])


@pytest.mark.parametrize("name", ["gpupool-replica@.service", "gpupool-router.service"])
def test_each_unit_drains_within_its_stop_timeout_and_restarts_on_failure(name: str) -> None:
    service = unit(name)["Service"]
    assert float(service["TimeoutStopSec"]) > drain_timeout(service["ExecStop"])
    assert service["Restart"] in ("on-failure", "always")
    assert service["KillSignal"] == "SIGTERM"


def test_the_replica_instance_is_the_gpu_it_sees_and_its_port() -> None:
    service = unit("gpupool-replica@.service")["Service"]
    assert "CUDA_VISIBLE_DEVICES=%i" in (SYSTEMD / "gpupool-replica@.service").read_text()
    assert "-m replica" in service["ExecStart"] and "--port 910%i" in service["ExecStart"]
    assert "http://127.0.0.1:910%i" in service["ExecStop"]


def test_the_stop_hook_the_units_call_exists_and_takes_their_flags() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "deploy.drain", "--help"],
        cwd=SYSTEMD.parents[1],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 0 and "--timeout-s" in out.stdout


def test_systemd_itself_accepts_every_line_of_both_units(tmp_path: Path) -> None:
    """`systemd-analyze verify` reads the units as systemd will: no key or value it ignores."""
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed")
    for name in ("gpupool-replica@.service", "gpupool-router.service"):
        text = (SYSTEMD / name).read_text().replace("/opt/gpupool/.venv/bin/python", sys.executable)
        (tmp_path / name.replace("@.", "@0.")).write_text(text)
    units = [str(tmp_path / "gpupool-replica@0.service"), str(tmp_path / "gpupool-router.service")]
    out = subprocess.run(
        [analyze, "verify", "--man=no", *units],
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
    )
    problems = [line for line in (out.stdout + out.stderr).splitlines() if tmp_path.name in line]
    assert out.returncode == 0 and problems == [], out.stdout + out.stderr
