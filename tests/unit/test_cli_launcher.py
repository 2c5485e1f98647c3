"""Launcher supervision with stand-in children (tiny HTTP servers): restart, give up, abort."""

from __future__ import annotations

import io
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from rich.console import Console

from common.config import parse_config
from deploy.launcher import Launcher
from deploy.plan import ChildSpec, child_env
from deploy.state import read_state
from tests.support import free_port

# Answers every request with `status` and a health body, printing "GET /health" for each. With
# `life` > 0 it exits with status 3 that long after its first request, so the launcher has always
# seen it answer first.
SERVER = """
import http.server, os, sys, threading
port, status, life = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
timer = threading.Timer(life, lambda: os._exit(3))
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        print(self.command, self.path, flush=True)
        if life > 0 and not timer.is_alive():
            timer.start()
        body = b'{"ready": true, "in_flight": 0, "queued": 0}'
        self.send_response(status)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    do_POST = do_GET
    def log_message(self, *args):
        pass
server = http.server.HTTPServer(("127.0.0.1", port), H)
print("serving", port, flush=True)
server.serve_forever()
"""


def spec(name: str, kind: str, port: int, status: int = 200, life: float = 0) -> ChildSpec:
    return ChildSpec(
        name=name,
        kind=kind,  # type: ignore[arg-type]
        argv=(sys.executable, "-c", SERVER, str(port), str(status), str(life)),
        env={},
        url=f"http://127.0.0.1:{port}",
        host="127.0.0.1",
        port=port,
        device="cpu",
    )


def make(
    tmp_path: Path, replica: ChildSpec | None, router_status: int = 200, **replicas: object
) -> tuple[Launcher, io.StringIO]:
    """A launcher of ``replica`` and a router; with no replica, a router-only host."""
    out = io.StringIO()
    devices = ["cpu"] if replica else []
    remote = [] if replica else [{"url": "http://127.0.0.1:1"}]
    cfg = parse_config({"replicas": {"devices": devices, **replicas}, "remote_replicas": remote})
    launcher = Launcher(
        cfg=cfg,
        specs=[
            *([replica] if replica else []),
            spec("router", "router", free_port(), router_status),
        ],
        console=Console(file=out, width=200),
        env=child_env({}, {"PATH": "/usr/bin:/bin"}),
        state_file=tmp_path / "up-1.json",
        log_dir=tmp_path / "logs",
        grace_s=2.0,
    )
    for t in launcher.tracked.values():
        t.policy.base_s = 0.1
    return launcher, out


@contextmanager
def stop_when(launcher: Launcher, predicate: object, timeout_s: float) -> Iterator[list[bool]]:
    """Set launcher.stop once ``predicate()`` holds (or after ``timeout_s``); record which."""
    seen: list[bool] = []

    def watch() -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not predicate():  # type: ignore[operator]
            time.sleep(0.05)
        seen.append(bool(predicate()))  # type: ignore[operator]
        launcher.stop.set()

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    yield seen
    watcher.join(timeout_s + 5)


def test_a_replica_that_keeps_crashing_is_restarted_then_reported_and_left_down(
    tmp_path: Path,
) -> None:
    launcher, out = make(tmp_path, spec("cpu0", "replica", free_port(), life=0.3), max_restarts=2)
    cpu0 = launcher.tracked["cpu0"]
    pids: set[int] = set()

    def down() -> bool:
        if cpu0.child is not None:
            pids.add(cpu0.child.pid)
        return cpu0.state == "down"

    with stop_when(launcher, down, 60) as seen:
        code = launcher.run()
    assert seen == [True]
    assert code == 0  # the router stayed up; the launcher stopped when asked
    assert cpu0.policy.restarts == 2 and len(pids) == 3
    text = out.getvalue()
    assert "cpu0 exited (status 3); restarting in 0.1s" in text
    assert "replica cpu0 exited (status 3) 3 times in a row; left down" in text
    assert not any(t.child and t.child.alive() for t in launcher.tracked.values())
    assert not launcher.state_file.exists()


def test_state_file_tells_status_the_restart_count_while_running(tmp_path: Path) -> None:
    launcher, _ = make(tmp_path, spec("cpu0", "replica", free_port(), life=0.3), max_restarts=5)
    snapshots: list[int] = []

    def restarted_once() -> bool:
        state = read_state(launcher.state_file)
        if state is None:
            return False
        cpu0 = next(c for c in state["children"] if c["name"] == "cpu0")
        snapshots.append(cpu0["restarts"])
        return bool(cpu0["restarts"] >= 1)

    with stop_when(launcher, restarted_once, 60) as seen:
        launcher.run()
    assert seen == [True]
    assert snapshots[0] == 0 and snapshots[-1] >= 1


def test_a_replica_that_exits_while_loading_stops_start_up_with_its_output(
    tmp_path: Path,
) -> None:
    launcher, out = make(tmp_path, spec("cpu0", "replica", free_port(), status=503, life=0.1))
    log = tmp_path / "logs" / "cpu0.log"
    log.parent.mkdir()
    log.write_text("an earlier run's last words\n")
    assert launcher.run() == 1
    text = out.getvalue()
    assert "error: cpu0 exited with status 3 while starting" in text
    assert "serving" in text  # its last output is shown
    assert "earlier run" not in text  # and only its own, though the log file keeps both
    assert log.read_text().startswith("an earlier run's last words\nserving")
    assert launcher.tracked["router"].child is None  # the router was never started


def test_the_ready_timeout_names_the_replica_that_did_not_load(tmp_path: Path) -> None:
    launcher, out = make(
        tmp_path, spec("cpu0", "replica", free_port(), status=503), ready_timeout_s=1.0
    )
    assert launcher.run() == 1
    assert "error: not ready after 1s: cpu0 (raise replicas.ready_timeout_s" in out.getvalue()
    assert not launcher.tracked["cpu0"].child.alive()  # type: ignore[union-attr]


def test_a_loading_replica_is_asked_for_its_health_about_once_a_second(tmp_path: Path) -> None:
    # A loading replica logs every /health it answers 503; polling it 5 times a second would
    # bury the launcher's output. Two seconds of loading: at most three asks (at 0, 1 and 2 s).
    launcher, out = make(
        tmp_path, spec("cpu0", "replica", free_port(), status=503), ready_timeout_s=2.0
    )
    assert launcher.run() == 1
    asks = out.getvalue().count("cpu0 | GET /health")
    assert 1 <= asks <= 3, out.getvalue()


def test_a_router_only_host_starts_just_the_router(tmp_path: Path) -> None:
    launcher, out = make(tmp_path, None)
    assert list(launcher.tracked) == ["router"]
    with stop_when(launcher, lambda: launcher.tracked["router"].state == "ready", 30) as seen:
        assert launcher.run() == 0
    assert seen == [True]
    text = out.getvalue()
    assert "gpupool is up" in text and "replica(s)" not in text
    assert "remote0" in text  # the summary lists the remote replica


def test_a_router_with_no_ready_replica_is_named_with_the_likely_reason(tmp_path: Path) -> None:
    launcher, out = make(tmp_path, None, router_status=503)
    launcher.router_ready_timeout_s = 1.0
    assert launcher.run() == 1
    assert "not ready after 1s: router (it has no ready replica" in out.getvalue()
