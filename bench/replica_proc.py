"""Start one replica process for a tuning step and stop it after (bench imports no replica code).

``python -m replica --config FILE --replica NAME --max-concurrency C --port P --host 127.0.0.1``
on a free loopback port; waits (bounded) for ``/health`` 200; SIGTERM, then SIGKILL, on exit.
Its output goes to a temporary log file, whose tail is shown when it fails to start, and which is
removed when the replica has stopped.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx


class ReplicaStartError(RuntimeError):
    """The replica exited or did not become ready in time; the message carries its log tail."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class ReplicaProcess:
    popen: subprocess.Popen[bytes]
    port: int
    log_path: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""


def _wait_ready(proc: ReplicaProcess, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    while time.monotonic() < deadline:
        code = proc.popen.poll()
        if code is not None:
            raise ReplicaStartError(
                f"the replica exited with status {code} while starting:\n{proc.log_tail()}"
            )
        try:
            r = httpx.get(proc.url + "/health", timeout=2.0)
            if r.status_code == 200:
                return
            last = f"{r.status_code}"
        except httpx.HTTPError as exc:
            last = type(exc).__name__
        time.sleep(0.1)
    raise ReplicaStartError(
        f"the replica was not ready after {timeout_s:g}s (last /health: {last}):\n{proc.log_tail()}"
    )


def _stop(proc: ReplicaProcess, grace_s: float = 15.0) -> None:
    if proc.popen.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        proc.popen.send_signal(signal.SIGTERM)
    try:
        proc.popen.wait(grace_s)
    except subprocess.TimeoutExpired:
        proc.popen.kill()
        proc.popen.wait(5)


@contextlib.contextmanager
def replica(
    args: Sequence[str],
    *,
    env: dict[str, str] | None = None,
    ready_timeout_s: float = 300.0,
    cwd: Path | None = None,
) -> Iterator[ReplicaProcess]:
    """Run ``python -m replica --port P --host 127.0.0.1 *args`` until the block ends."""
    port = free_port()
    command = [sys.executable, "-m", "replica", *args, "--port", str(port), "--host", "127.0.0.1"]
    with tempfile.NamedTemporaryFile(
        prefix=f"tune-replica-{port}-", suffix=".log", delete=False
    ) as log:
        popen = subprocess.Popen(
            command,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
            cwd=cwd,
        )
        proc = ReplicaProcess(popen=popen, port=port, log_path=Path(log.name))
        try:
            _wait_ready(proc, ready_timeout_s)
            yield proc
        finally:
            _stop(proc)
            proc.log_path.unlink(missing_ok=True)
