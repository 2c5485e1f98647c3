"""Checks `gpupool up` makes before it starts anything, so nothing ever half-starts.

Ports free, GPUs present with room for the model, the model source there and prepared once.
Each check raises ``PreflightError`` with a message for a person.
"""

from __future__ import annotations

import errno
import os
import socket
import subprocess
from collections.abc import Callable, Mapping, Sequence

from common.config import DeploymentConfig
from common.gpu import GpuInfo
from deploy.plan import ChildSpec, is_simulated, room_problems
from deploy.procs import die_with_parent


class PreflightError(RuntimeError):
    """Something that must be fixed before `gpupool up` can start."""


def port_problem(host: str, port: int) -> str | None:
    """Why ``host:port`` cannot be listened on, or None when it can."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        # As uvicorn does: a port in TIME_WAIT is free, one with a listener is not.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return "already in use"
            return exc.strerror or str(exc)
    return None


def check_ports(children: Sequence[ChildSpec]) -> None:
    problems = []
    for child in children:
        why = port_problem(child.host, child.port)
        if why is not None:
            problems.append(f"port {child.port} ({child.name}, {child.host}): {why}")
    if problems:
        raise PreflightError(
            "cannot start: " + "; ".join(problems) + ". Stop what uses it (another `gpupool up`?) "
            "or change replicas.port_base / router.port."
        )


Runner = Callable[[Sequence[str], float], "subprocess.CompletedProcess[str]"]


def run_tool(argv: Sequence[str], timeout_s: float) -> subprocess.CompletedProcess[str]:
    """Run a helper command, output captured, bounded in time, killed if we die."""
    try:
        return subprocess.run(
            list(argv),
            capture_output=True,
            text=True,
            timeout=timeout_s,
            stdin=subprocess.DEVNULL,
            preexec_fn=die_with_parent(os.getpid()),
        )
    except subprocess.TimeoutExpired as exc:
        raise PreflightError(f"`{' '.join(argv)}` did not finish in {timeout_s:.0f}s") from exc


def _models(python: str, *args: str) -> list[str]:
    return [python, "-m", "replica.models", *args]


def _message(proc: subprocess.CompletedProcess[str]) -> str:
    text = (proc.stderr or "").strip() or (proc.stdout or "").strip()
    lines = text.splitlines()
    return "\n".join(lines[-8:]) if lines else f"exit status {proc.returncode}"


def prepare_model(
    cfg: DeploymentConfig, python: str, run: Runner = run_tool, prepare_timeout_s: float = 1800
) -> None:
    """Check the model source (simulated options too), then convert/cache it once."""
    source = cfg.model.source
    checked = run(_models(python, "check", source), 120)
    if checked.returncode != 0:
        raise PreflightError(f"model.source {source!r}: {_message(checked)}")
    if is_simulated(source):
        return
    prepared = run(_models(python, "prepare", source), prepare_timeout_s)
    if prepared.returncode != 0:
        raise PreflightError(f"model.source {source!r}: preparing failed: {_message(prepared)}")


def estimate_weights(cfg: DeploymentConfig, python: str, run: Runner = run_tool) -> int:
    """Bytes of the model's weights at the configured dtype (`replica.models estimate`)."""
    dtype = cfg.model.dtype if cfg.model.dtype != "auto" else "bfloat16"
    proc = run(_models(python, "estimate", cfg.model.source, "--dtype", dtype), 300)
    lines = (proc.stdout or "").strip().splitlines()
    if proc.returncode != 0 or not lines or not lines[-1].strip().isdigit():
        raise PreflightError(
            f"model.source {cfg.model.source!r}: cannot estimate its size: {_message(proc)}"
        )
    return int(lines[-1].strip())


def check_gpu_room(
    cfg: DeploymentConfig,
    gpus: Sequence[GpuInfo],
    python: str,
    run: Runner = run_tool,
) -> None:
    """Every GPU replica's GPU has free memory for the weights plus ``replicas.headroom_mb``."""
    devices = cfg.replicas.devices
    indices = [d for d in devices if d != "cpu"] if isinstance(devices, list) else []
    if not indices or is_simulated(cfg.model.source):
        return
    weights = estimate_weights(cfg, python, run)
    problems = room_problems(gpus, [int(i) for i in indices], weights, cfg.replicas.headroom_mb)
    if problems:
        raise PreflightError("not enough GPU memory:\n  " + "\n  ".join(problems))


def already_running(state: Mapping[str, object] | None, port: int) -> None:
    if state is not None:
        raise PreflightError(
            f"`gpupool up` is already running on router port {port} "
            f"(launcher pid {state.get('launcher_pid')}); stop it first, or change router.port"
        )
