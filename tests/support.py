"""Helpers for tests that start real gpupool processes on loopback ports.

Every wait is bounded; every process is stopped (SIGTERM, then SIGKILL) when its block ends;
each process's output goes to a log file whose tail is shown when start-up fails.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import httpx

REPO = Path(__file__).resolve().parent.parent


# Listening ports for tests come from below Linux's ephemeral range (32768-60999), where the
# kernel never picks source ports for outgoing connections: a port found free here stays free
# until the test's server binds it, even while other tests open thousands of connections.
_PORT_RANGE = (20000, 32000)
_handed_out: set[int] = set()
_rng = random.Random()


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_ports(count: int) -> int:
    """The first of ``count`` consecutive free ports, none handed out before in this process."""
    for _ in range(500):
        base = _rng.randrange(_PORT_RANGE[0], _PORT_RANGE[1] - count)
        ports = range(base, base + count)
        if any(p in _handed_out for p in ports) or not all(_bindable(p) for p in ports):
            continue
        _handed_out.update(ports)
        return base
    raise RuntimeError(f"no {count} consecutive free ports in {_PORT_RANGE}")


def free_port() -> int:
    return free_ports(1)


@dataclass
class Proc:
    popen: subprocess.Popen[bytes]
    port: int
    log_path: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        return self.popen.pid

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""


class Watched(Protocol):
    popen: subprocess.Popen[bytes]

    def log(self) -> str: ...


def wait_http(url: str, timeout_s: float, proc: Watched | None = None, want: int = 200) -> None:
    """Poll ``url`` until it answers ``want``; fail with the process log on timeout or exit."""
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    while time.monotonic() < deadline:
        if proc is not None and proc.popen.poll() is not None:
            raise RuntimeError(
                f"process exited with {proc.popen.returncode} before {url} was ready:\n"
                + proc.log()[-4000:]
            )
        try:
            r = httpx.get(url, timeout=2.0)
            if r.status_code == want:
                return
            last = f"{r.status_code} {r.text[:200]}"
        except httpx.HTTPError as exc:
            last = repr(exc)
        time.sleep(0.1)
    log = proc.log()[-4000:] if proc is not None else ""
    raise TimeoutError(f"{url} not ready after {timeout_s}s (last: {last})\n{log}")


def stop(proc: Proc, grace_s: float = 10.0) -> None:
    if proc.popen.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.popen.send_signal(signal.SIGCONT)  # in case a test left it stopped
            proc.popen.terminate()
        try:
            proc.popen.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.popen.kill()
            proc.popen.wait(5)


@contextlib.contextmanager
def python_module(
    module: str,
    args: Sequence[str],
    *,
    port: int,
    ready_path: str | None = "/health",
    ready_timeout_s: float = 120.0,
    env: Mapping[str, str] | None = None,
) -> Iterator[Proc]:
    """Run ``python -m module *args``; wait until ``ready_path`` answers 200; stop it after."""
    fd, log_name = tempfile.mkstemp(prefix=f"{module}-{port}-", suffix=".log")
    log_file = os.fdopen(fd, "wb")
    full_env = {**os.environ, **(env or {})}
    full_env.setdefault("PYTHONUNBUFFERED", "1")
    popen = subprocess.Popen(
        [sys.executable, "-m", module, *args],
        cwd=REPO,
        stdout=log_file,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        env=full_env,
    )
    proc = Proc(popen=popen, port=port, log_path=Path(log_name))
    try:
        if ready_path is not None:
            wait_http(proc.url + ready_path, ready_timeout_s, proc)
        yield proc
    finally:
        stop(proc)
        log_file.close()


@contextlib.contextmanager
def replica_process(*args: str, port: int | None = None, **kwargs: object) -> Iterator[Proc]:
    """A real replica: ``python -m replica --port P *args`` (e.g. ``--model simulated``)."""
    port = port or free_port()
    with python_module("replica", ["--port", str(port), *args], port=port, **kwargs) as p:  # type: ignore[arg-type]
        yield p


@contextlib.contextmanager
def router_process(*args: str, port: int | None = None, **kwargs: object) -> Iterator[Proc]:
    """A real router: ``python -m router --port P *args`` (e.g. ``--replica URL``)."""
    port = port or free_port()
    with python_module("router", ["--port", str(port), *args], port=port, **kwargs) as p:  # type: ignore[arg-type]
        yield p
