"""What `gpupool up` will start, computed without starting anything.

Pure functions over a ``DeploymentConfig``: which child processes (argv, environment, health URL),
the restart backoff schedule, and the room-on-the-GPU arithmetic. The launcher does the I/O.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from common.config import ConfigError, DeploymentConfig, parse_config
from common.gpu import GpuInfo, pin_to_gpu

MIB = 1024 * 1024
PROJECT_ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class ChildSpec:
    """One process `gpupool up` runs and supervises."""

    name: str  # cpu0, gpu3, router
    kind: Literal["replica", "router"]
    argv: tuple[str, ...]
    env: Mapping[str, str]  # added to the launcher's environment
    url: str  # base URL; GET url + /health tells whether it is ready
    host: str
    port: int
    device: str  # cpu, cuda (one visible GPU), or "-" for the router


def local_url(host: str, port: int) -> str:
    """The URL to reach a server bound to ``host`` from this machine."""
    reachable = "127.0.0.1" if host in ("0.0.0.0", "", "::") else host
    return f"http://{reachable}:{port}"


def is_simulated(source: str) -> bool:
    return source == "simulated" or source.startswith("simulated:")


def gpu_indices_needed(cfg: DeploymentConfig) -> bool:
    """True when start-up must ask NVML about GPUs (``all`` or any GPU index)."""
    devices = cfg.replicas.devices
    return devices == "all" or any(d != "cpu" for d in devices)


def resolve_devices(
    cfg: DeploymentConfig, gpus: Sequence[GpuInfo], nvml_error: str | None
) -> DeploymentConfig:
    """The config with ``devices: all`` replaced by the GPU indices NVML sees.

    Raises ConfigError when ``all`` finds no GPU, a listed index does not exist, or the ports of
    the GPUs found collide with the router's (checked again now that the count is known).
    """
    present = [g.index for g in gpus]
    why = f" ({nvml_error})" if nvml_error else ""
    devices = cfg.replicas.devices
    if devices == "all":
        if not present:
            raise ConfigError(
                f'replicas.devices: "all" but no GPU was found{why}; list devices: [cpu] '
                "to run on the CPU"
            )
        resolved: list[int | Literal["cpu"]] = list(present)
    else:
        missing = [d for d in devices if d != "cpu" and d not in present]
        if missing:
            seen = ", ".join(str(i) for i in present) or "none"
            raise ConfigError(
                f"replicas.devices: GPU {', '.join(str(m) for m in missing)} not found "
                f"(GPUs present: {seen}){why}"
            )
        resolved = list(devices)
    data = cfg.model_dump()
    data["replicas"]["devices"] = resolved
    return parse_config(data, origin=f'replicas.devices: "all" = {resolved}')


def child_env(extra: Mapping[str, str], base: Mapping[str, str]) -> dict[str, str]:
    """The full environment of a child: ours, plus ``extra``, able to import gpupool."""
    env = dict(base)
    env.update(extra)
    path = env.get("PYTHONPATH", "")
    parts = [p for p in path.split(":") if p]
    if str(PROJECT_ROOT) not in parts:
        env["PYTHONPATH"] = ":".join([str(PROJECT_ROOT), *parts])
    env["PYTHONUNBUFFERED"] = "1"
    return env


def build_children(cfg: DeploymentConfig, config_path: Path, python: str) -> list[ChildSpec]:
    """Replicas first (one per local device), the router last. ``cfg`` must be resolved."""
    specs = []
    for s in cfg.replica_settings():
        extra = pin_to_gpu(s.cuda_visible_devices) if s.cuda_visible_devices else {}
        specs.append(
            ChildSpec(
                name=s.name,
                kind="replica",
                argv=(python, "-m", "replica", "--config", str(config_path), "--replica", s.name),
                env=extra,
                url=local_url(s.host, s.port),
                host=s.host,
                port=s.port,
                device=f"GPU {s.cuda_visible_devices}" if s.cuda_visible_devices else s.device,
            )
        )
    r = cfg.router
    specs.append(
        ChildSpec(
            name="router",
            kind="router",
            argv=(python, "-m", "router", "--config", str(config_path)),
            env={},
            url=local_url(r.host, r.port),
            host=r.host,
            port=r.port,
            device="-",
        )
    )
    return specs


def backoff_delay(failures: int, base_s: float = 1.0, cap_s: float = 30.0) -> float:
    """Seconds before restart number ``failures`` (1, 2, 4, ... capped)."""
    if failures < 1:
        return 0.0
    return float(min(cap_s, base_s * 2 ** (failures - 1)))


@dataclass
class RestartPolicy:
    """Consecutive crashes of one child -> wait before restarting it, or give up.

    A child that stayed up for ``stable_s`` before exiting starts a fresh count, so a crash once
    a day never exhausts ``max_restarts``.
    """

    max_restarts: int
    base_s: float = 1.0
    cap_s: float = 30.0
    stable_s: float = 60.0
    consecutive: int = 0
    restarts: int = field(default=0)

    def on_exit(self, started_at: float, now: float) -> float | None:
        """Record an exit; the delay before restarting, or None to leave the child down."""
        if now - started_at >= self.stable_s:
            self.consecutive = 0
        self.consecutive += 1
        if self.consecutive > self.max_restarts:
            return None
        return backoff_delay(self.consecutive, self.base_s, self.cap_s)

    def on_restart(self) -> None:
        self.restarts += 1


def room_problems(
    gpus: Sequence[GpuInfo], indices: Sequence[int], weights_bytes: int, headroom_mb: int
) -> list[str]:
    """One message per GPU without free memory for the weights plus the headroom."""
    by_index = {g.index: g for g in gpus}
    need = weights_bytes + headroom_mb * MIB
    problems = []
    for index in indices:
        gpu = by_index.get(index)
        if gpu is None:
            continue
        free = gpu.memory.free_bytes
        if free < need:
            problems.append(
                f"GPU {index} ({gpu.name}): {free / MIB:,.0f} MiB free, the model needs "
                f"{weights_bytes / MIB:,.0f} MiB + {headroom_mb:,} MiB headroom "
                f"(replicas.headroom_mb); free the GPU or leave it out of replicas.devices"
            )
    return problems
