"""`gpupool up`: turn a deployment YAML into a running, supervised fleet.

Order: validate the config; find the GPUs; refuse if a port is taken, a GPU lacks room or the model
is missing (nothing has started yet); prepare the model once; start every replica at once and
wait until each reports ready; start the router; supervise (restart crashed children with
exponential backoff, give up on one that keeps crashing); on SIGTERM/SIGINT drain the router,
wait for in-flight requests up to ``router.drain_timeout_s``, SIGTERM everything, SIGKILL after a
grace period. Exit status: 0 after a clean stop, 1 when start-up or the router failed, 2 when the
configuration or the machine cannot run it (nothing was started), 130 on Ctrl-C before start.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

import httpx
import yaml
from rich.console import Console
from rich.live import Live
from rich.table import Table
from rich.text import Text

from common.config import ConfigError, DeploymentConfig, load_config
from common.gpu import list_gpus, nvml_error
from deploy import display, preflight
from deploy.drain import admin_key, bearer, busy
from deploy.plan import (
    ChildSpec,
    RestartPolicy,
    build_children,
    child_env,
    gpu_indices_needed,
    is_simulated,
    resolve_devices,
)
from deploy.procs import Child, spawn, terminate_all
from deploy.state import read_state, state_dir, state_path, write_state

POLL_S = 0.2  # how often exits are noticed and the loading table is redrawn
# How often a starting child's /health is asked: a loading replica logs each 503 it answers.
PROBE_S = 1.0
# Why a child is not ready in time, by kind: replicas load slowly; the router's /health is 503
# until at least one replica answers ready.
LATE_HINT = {
    "replica": "raise replicas.ready_timeout_s if loading is just slow",
    "router": "it has no ready replica: are remote_replicas / router.discovery reachable?",
}


@dataclass
class Tracked:
    """A child spec, its current process, and what happened to it."""

    spec: ChildSpec
    policy: RestartPolicy
    child: Child | None = None
    state: str = "starting"  # starting | ready | backoff | down | stopped
    restart_at: float | None = None
    last_exit: int | None = None
    next_probe: float = 0.0


@dataclass
class Launcher:
    cfg: DeploymentConfig
    specs: list[ChildSpec]
    console: Console
    env: Mapping[str, str]
    state_file: Path
    log_dir: Path
    config_file: Path | None = None  # the resolved YAML the children read; removed at the end
    clock: Callable[[], float] = time.monotonic
    grace_s: float = 10.0
    router_ready_timeout_s: float = 120.0
    stop: threading.Event = field(default_factory=threading.Event)
    force: threading.Event = field(default_factory=threading.Event)
    _print_lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        r = self.cfg.replicas
        self.tracked = {
            s.name: Tracked(spec=s, policy=RestartPolicy(max_restarts=r.max_restarts))
            for s in self.specs
        }
        self.http = httpx.Client(timeout=httpx.Timeout(2.0))

    # -- output ------------------------------------------------------------------------------

    def _line(self, name: str, line: str) -> None:
        style = "magenta" if name == "router" else "cyan"
        with self._print_lock:
            self.console.print(
                Text.assemble((f"{name:>7} | ", style), line), soft_wrap=True, highlight=False
            )

    def _say(self, message: str, style: str = "bold") -> None:
        with self._print_lock:
            self.console.print(Text(message, style=style), soft_wrap=True, highlight=False)

    # -- children ----------------------------------------------------------------------------

    def _start(self, t: Tracked) -> None:
        t.child = spawn(
            t.spec.name,
            t.spec.argv,
            {**self.env, **t.spec.env},
            self.log_dir / f"{t.spec.name}.log",
            self._line,
            self.clock,
        )
        t.state, t.restart_at, t.next_probe = "starting", None, 0.0
        self._save()

    def _probe_due(self, t: Tracked) -> bool:
        """True at most once per PROBE_S per child (and at once after a start)."""
        now = self.clock()
        if now < t.next_probe:
            return False
        t.next_probe = now + PROBE_S
        return True

    def _ready(self, t: Tracked) -> bool:
        try:
            r = self.http.get(t.spec.url + "/health")
        except httpx.HTTPError:
            return False
        if r.status_code != 200:
            return False
        if t.spec.kind == "router":
            return True
        try:
            return bool(r.json().get("ready", True))
        except ValueError:
            return False

    def _save(self) -> None:
        data: dict[str, Any] = {
            "launcher_pid": os.getpid(),
            "router_url": self.tracked["router"].spec.url,
            "model": self.cfg.model.source,
            "log_dir": str(self.log_dir),
            "children": [
                {
                    "name": t.spec.name,
                    "kind": t.spec.kind,
                    "url": t.spec.url,
                    "device": t.spec.device,
                    "pid": t.child.pid if t.child and t.child.alive() else None,
                    "state": t.state,
                    "restarts": t.policy.restarts,
                    "last_exit": t.last_exit,
                }
                for t in self.tracked.values()
            ],
        }
        try:
            write_state(self.state_file, data)
        except OSError as exc:
            self._say(f"warning: cannot write {self.state_file}: {exc}", "yellow")

    # -- start-up ----------------------------------------------------------------------------

    def _table(self, names: list[str], began: float) -> Table:
        rows = [(n, self.tracked[n].spec, self.tracked[n].state == "ready") for n in names]
        return display.loading_table(rows, self.clock() - began)

    def _wait_ready(self, names: list[str], timeout_s: float) -> str | None:
        """Wait until every named child is ready; the problem, or None on success."""
        began = self.clock()
        deadline = began + timeout_s
        with Live(self._table(names, began), console=self.console, transient=True) as live:
            while True:
                pending = [n for n in names if self.tracked[n].state != "ready"]
                if not pending:
                    return None
                if self.stop.is_set():
                    return "interrupted while starting"
                for name in pending:
                    t = self.tracked[name]
                    assert t.child is not None
                    if not t.child.alive():
                        t.last_exit = t.child.popen.returncode
                        return (
                            f"{name} exited with status {t.last_exit} while starting; "
                            f"its last output:\n{t.child.tail()}"
                        )
                    if self._probe_due(t) and self._ready(t):
                        t.state = "ready"
                        self._save()
                if self.clock() >= deadline:
                    late = [n for n in names if self.tracked[n].state != "ready"]
                    hint = LATE_HINT[self.tracked[late[0]].spec.kind]
                    return f"not ready after {timeout_s:.0f}s: {', '.join(late)} ({hint})"
                live.update(self._table(names, began))
                self.stop.wait(POLL_S)

    def start(self) -> str | None:
        """Start replicas in parallel, then the router; the problem, or None when all are up."""
        replicas = [n for n, t in self.tracked.items() if t.spec.kind == "replica"]
        for name in replicas:
            self._start(self.tracked[name])
        if replicas:
            self._say(f"started {len(replicas)} replica(s); waiting for them to load", "")
            problem = self._wait_ready(replicas, self.cfg.replicas.ready_timeout_s)
            if problem is not None:
                return problem
        self._start(self.tracked["router"])
        return self._wait_ready(["router"], self.router_ready_timeout_s)

    def summary(self) -> None:
        specs = [t.spec for t in self.tracked.values()]
        with self._print_lock:
            display.print_summary(self.console, self.cfg, specs, self.log_dir)

    # -- supervision -------------------------------------------------------------------------

    def _on_exit(self, t: Tracked, now: float) -> None:
        assert t.child is not None
        t.last_exit = t.child.popen.returncode
        delay = t.policy.on_exit(t.child.started_at, now)
        if delay is None:
            t.state, t.restart_at = "down", None
            what = "the router" if t.spec.kind == "router" else f"replica {t.spec.name}"
            self._say(
                f"{what} exited (status {t.last_exit}) {t.policy.consecutive} times in a row; "
                f"left down (replicas.max_restarts={t.policy.max_restarts})",
                "bold red",
            )
        else:
            t.state, t.restart_at = "backoff", now + delay
            self._say(
                f"{t.spec.name} exited (status {t.last_exit}); restarting in {delay:g}s",
                "yellow",
            )
        self._save()

    def supervise(self) -> int:
        """Watch the children until asked to stop; 1 if the router could not be kept up."""
        while not self.stop.is_set():
            now = self.clock()
            for t in self.tracked.values():
                if t.child is not None and t.state in ("starting", "ready") and not t.child.alive():
                    self._on_exit(t, now)
                elif t.state == "backoff" and t.restart_at is not None and now >= t.restart_at:
                    t.policy.on_restart()
                    self._start(t)
                elif t.state == "starting" and self._probe_due(t) and self._ready(t):
                    t.state = "ready"
                    self._say(f"{t.spec.name} is ready again", "green")
                    self._save()
            if self.tracked["router"].state == "down":
                return 1
            self.stop.wait(POLL_S)
        return 0

    # -- shutdown ----------------------------------------------------------------------------

    def _busy(self) -> int:
        """Requests still being served: the router's in-flight plus the replicas' own."""
        total = 0
        for t in self.tracked.values():
            if t.child is None or not t.child.alive():
                continue
            try:
                body = self.http.get(t.spec.url + "/health").json()
            except (httpx.HTTPError, ValueError):
                continue
            total += busy(body)  # the router's /health has no "queued"
        return total

    def drain(self) -> None:
        """Router stops admitting; wait for in-flight requests up to router.drain_timeout_s."""
        router = self.tracked["router"]
        if router.child is None or not router.child.alive():
            return
        r = self.cfg.router
        key = admin_key(self.env, r.admin_keys_env, r.api_keys_env)
        try:
            self.http.post(router.spec.url + "/admin/drain", headers=bearer(key))
        except httpx.HTTPError:
            return
        timeout = self.cfg.router.drain_timeout_s
        self._say(f"draining: waiting up to {timeout:g}s for in-flight requests", "yellow")
        deadline = self.clock() + timeout
        while self.clock() < deadline and not self.force.is_set():
            busy = self._busy()
            if busy == 0:
                return
            self.force.wait(POLL_S)
        self._say("drain timeout passed; stopping with requests still running", "red")

    def shutdown(self) -> None:
        self.drain()
        children = [t.child for t in self.tracked.values() if t.child is not None]
        terminate_all(children, 0.0 if self.force.is_set() else self.grace_s)
        for t in self.tracked.values():
            t.state = "stopped"
        self.http.close()
        self.state_file.unlink(missing_ok=True)
        if self.config_file is not None:
            self.config_file.unlink(missing_ok=True)

    def run(self) -> int:
        try:
            problem = self.start()
            if problem is not None and self.stop.is_set():
                return 0  # asked to stop while starting: not an error
            if problem is not None:
                self._say(f"error: {problem}", "bold red")
                return 1
            self.summary()
            code = self.supervise()
            if code != 0:
                self._say("error: the router keeps exiting; stopping everything", "bold red")
            return code
        finally:
            self._say("stopping", "")
            self.shutdown()
            self._say("stopped; no child left", "")


def resolve_config_path(arg: str | None, cwd: Path) -> Path:
    """CONFIG relative to cwd; with none, ./configs/local.yaml, else the one shipped with us."""
    if arg is not None:
        return (cwd / arg).resolve()
    here = cwd / "configs" / "local.yaml"
    if here.is_file():
        return here.resolve()
    return Path(__file__).resolve().parent.parent / "configs" / "local.yaml"


def _install_signals(launcher: Launcher) -> dict[int, Any]:
    def handler(signum: int, frame: FrameType | None) -> None:
        if launcher.stop.is_set():
            launcher.force.set()  # a second Ctrl-C: stop now, do not wait for the drain
        launcher.stop.set()

    return {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGINT)}


def run_up(config_arg: str | None, console: Console, env: Mapping[str, str] | None = None) -> int:
    """The whole of `gpupool up`; returns the exit status."""
    env = dict(os.environ if env is None else env)
    path = resolve_config_path(config_arg, Path.cwd())
    python = sys.executable
    try:
        cfg = load_config(path)
        gpus = list_gpus() if gpu_indices_needed(cfg) else []
        if gpu_indices_needed(cfg):
            cfg = resolve_devices(cfg, gpus, nvml_error())
        port = cfg.router.port
        preflight.already_running(read_state(state_path(env, port)), port)
        run_dir = state_dir(env)
        resolved = run_dir / f"up-{port}.config.yaml"
        specs = build_children(cfg, resolved, python)
        preflight.check_ports(specs)
        preflight.check_gpu_room(cfg, gpus, python)
        if not is_simulated(cfg.model.source):
            console.print(f"checking and preparing model {cfg.model.source} ...", highlight=False)
        preflight.prepare_model(cfg, python)
    except (ConfigError, preflight.PreflightError) as exc:
        console.print(Text(f"error: {exc}", style="bold red"), soft_wrap=True)
        return 2
    except KeyboardInterrupt:  # Ctrl-C while checking or preparing: nothing was started
        console.print("interrupted; nothing was started")
        return 130
    # Children read the resolved file: `devices: all` already replaced by GPU indices.
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        resolved.write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
    except OSError as exc:
        console.print(
            Text(
                f"error: cannot write the state dir {run_dir}: {exc.strerror or exc} "
                "(set GPUPOOL_STATE_DIR to a writable folder)",
                style="bold red",
            ),
            soft_wrap=True,
        )
        return 2
    launcher = Launcher(
        cfg=cfg,
        specs=specs,
        console=console,
        env=child_env({}, env),
        state_file=state_path(env, port),
        log_dir=run_dir / f"logs-{port}",
        config_file=resolved,
    )
    previous = _install_signals(launcher)
    try:
        return launcher.run()
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
