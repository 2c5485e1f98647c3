"""Child processes that cannot outlive the launcher.

Each child runs in its own process group (a Ctrl-C in the terminal reaches only the launcher,
which then drains in order) and asks the kernel for SIGKILL when the launcher dies
(``prctl(PR_SET_PDEATHSIG)``), so even ``kill -9`` of the launcher leaves no orphan. The death
signal follows the *thread* that forked, so children must be spawned from the main thread.
Output is read by a thread per child, prefixed with the child's name, and copied to a log file.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

PR_SET_PDEATHSIG = 1

# Loaded in the parent: the pre-exec hook runs between fork and exec and must not import.
_libc: ctypes.CDLL | None
try:
    _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
except OSError:  # not Linux: no death signal, process groups still apply
    _libc = None


def die_with_parent(parent_pid: int) -> Callable[[], None]:
    def hook() -> None:
        if _libc is not None:
            _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent_pid:  # the launcher died before the hook ran
            os._exit(1)

    return hook


LineSink = Callable[[str, str], None]  # (child name, line)


@dataclass
class Child:
    name: str
    popen: subprocess.Popen[bytes]
    started_at: float
    log_path: Path
    # Where this process's output starts in the log, which keeps earlier runs and restarts.
    log_start: int = 0
    _reader: threading.Thread | None = field(default=None, repr=False)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def signal_group(self, sig: int) -> None:
        """Send ``sig`` to the child's whole process group (no-op once it is gone)."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.popen.pid, sig)

    def tail(self, lines: int = 20) -> str:
        """The last ``lines`` lines this process wrote (not an earlier run's)."""
        try:
            with self.log_path.open("rb") as log:
                log.seek(self.log_start)
                text = log.read().decode(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])


def _pump(name: str, stream: IO[bytes], log: IO[bytes], sink: LineSink) -> None:
    with stream, log:
        for raw in iter(stream.readline, b""):
            log.write(raw)
            log.flush()
            sink(name, raw.decode(errors="replace").rstrip("\n"))


def spawn(
    name: str,
    argv: Sequence[str],
    env: Mapping[str, str],
    log_path: Path,
    sink: LineSink,
    clock: Callable[[], float] = time.monotonic,
) -> Child:
    """Start ``argv`` as a supervised child; its output goes to ``sink`` and ``log_path``."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log = log_path.open("ab")
    log_start = log.tell()
    popen = subprocess.Popen(
        list(argv),
        env=dict(env),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        process_group=0,
        preexec_fn=die_with_parent(os.getpid()),
    )
    assert popen.stdout is not None
    reader = threading.Thread(
        target=_pump, args=(name, popen.stdout, log, sink), name=f"log-{name}", daemon=True
    )
    reader.start()
    return Child(
        name=name,
        popen=popen,
        started_at=clock(),
        log_path=log_path,
        log_start=log_start,
        _reader=reader,
    )


def terminate_all(children: Sequence[Child], grace_s: float) -> None:
    """SIGTERM every child's group, wait up to ``grace_s``, then SIGKILL what is left."""
    for child in children:
        if child.alive():
            child.signal_group(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for child in children:
        remaining = max(0.0, deadline - time.monotonic())
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.popen.wait(remaining)
    for child in children:
        # The group too: a grandchild must not survive its parent's clean exit.
        child.signal_group(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.popen.wait(5.0)
        if child._reader is not None:
            child._reader.join(timeout=2.0)
