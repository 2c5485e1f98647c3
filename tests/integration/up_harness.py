"""Run `gpupool up` as a real process for a test, and look for what it leaves behind in /proc."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common.config import load_config
from tests.support import REPO, wait_http


@dataclass
class Up:
    popen: subprocess.Popen[bytes]
    url: str
    state_dir: Path
    log_path: Path
    env: dict[str, str]

    def state(self) -> dict[str, Any]:
        files = list(self.state_dir.glob("up-*.json"))
        assert len(files) == 1, files
        data: dict[str, Any] = json.loads(files[0].read_text())
        return data

    def child(self, name: str) -> dict[str, Any]:
        return next(c for c in self.state()["children"] if c["name"] == name)

    def wait_restarted(self, name: str, old_pid: int, timeout_s: float) -> None:
        """Until the launcher runs ``name`` again (a pid other than ``old_pid``) and it is ready."""

        def restarted() -> bool:
            child = self.child(name)
            return child["pid"] not in (None, old_pid) and child["state"] == "ready"

        wait_until(restarted, timeout_s, f"{name} restarted and ready")

    def pids(self) -> list[int]:
        return [c["pid"] for c in self.state()["children"] if c["pid"]]

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def alive(pid: int) -> bool:
    """Running (not gone, not a zombie waiting to be reaped)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[-1].split()[0] != "Z"


def processes_mentioning(text: str) -> list[int]:
    """Live pids whose command line contains ``text``: a scan of /proc, no psutil."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmdline and alive(int(entry.name)):
            found.append(int(entry.name))
    return found


def wait_until(predicate: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")


@contextmanager
def gpupool_up(tmp_path: Path, config: Path, ready_timeout_s: float = 120) -> Iterator[Up]:
    """`python -m deploy up CONFIG` with its own state dir; yields once the summary is printed.

    On the way out: SIGTERM (SIGKILL after 40 s), then SIGKILL to any child still alive.
    """
    state_dir = tmp_path / "state"
    env = {**os.environ, "GPUPOOL_STATE_DIR": str(state_dir), "PYTHONPATH": str(REPO)}
    log_path = tmp_path / "up.log"
    with log_path.open("wb") as log:
        popen = subprocess.Popen(
            [sys.executable, "-m", "deploy", "up", str(config)],
            cwd=REPO,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
    up = Up(popen, f"http://127.0.0.1:{load_config(config).router.port}", state_dir, log_path, env)
    pids: list[int] = []
    try:
        try:
            wait_http(up.url + "/health", ready_timeout_s, up)
        except TimeoutError as exc:
            raise AssertionError(up.log()[-4000:]) from exc
        wait_until(lambda: "gpupool is up" in up.log(), 30, "the summary")
        pids = up.pids()
        yield up
    finally:
        with suppress(Exception):
            pids = sorted(set(pids) | set(up.pids()))
        if popen.poll() is None:
            popen.terminate()
            try:
                popen.wait(40)
            except subprocess.TimeoutExpired:
                popen.kill()
                popen.wait(5)
        for pid in pids:  # never leave a child behind, even when the test failed
            with suppress(ProcessLookupError):
                if alive(pid):
                    os.kill(pid, signal.SIGKILL)
