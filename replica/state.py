"""What the replica's routes share: settings, engine, probe, gate, metrics, load status."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from starlette.requests import Request

from common.config import ReplicaSettings
from common.gpu import GpuProbe
from common.protocol import HealthReport
from replica.engine import Engine
from replica.errors import NotReady
from replica.gate import Gate
from replica.metrics import ReplicaMetrics


@dataclass
class ReplicaState:
    """Everything the routes share; built by ``replica.app.create_app``."""

    settings: ReplicaSettings
    engine: Engine
    probe: GpuProbe
    gate: Gate
    metrics: ReplicaMetrics
    clock: Callable[[], float]
    started_at: float
    status: Literal["loading", "ready", "failed"] = "loading"
    error: str | None = None
    load_exception: BaseException | None = None

    @property
    def ready(self) -> bool:
        return self.status == "ready" and not self.gate.draining

    def peak_memory_bytes(self) -> int | None:
        """The engine's peak once loaded; None before, or if the engine cannot say."""
        try:
            return self.engine.peak_memory_bytes() if self.status == "ready" else None
        except Exception:  # a probe must never break /health or /metrics
            return None

    def health(self) -> HealthReport:
        draining = self.gate.draining
        status = self.status if self.status != "ready" else ("draining" if draining else "ready")
        return HealthReport(
            ready=self.ready,
            device=self.settings.device,
            model=self.engine.model_id,
            in_flight=self.gate.in_flight,
            queued=self.gate.queued,
            max_concurrency=self.gate.max_concurrency,
            max_queue=self.gate.max_queue,
            memory=self.probe.read(),
            peak_memory_bytes=self.peak_memory_bytes(),
            uptime_s=round(self.clock() - self.started_at, 3),
            draining=draining,
            completed=self.gate.completed,
            status=status,
            error=self.error,
        )

    def check_ready(self) -> None:
        if self.status == "loading":
            raise NotReady("the model is still loading; retry shortly")
        if self.status == "failed":
            raise NotReady(f"the model failed to load: {self.error}")


def state_of(request: Request) -> ReplicaState:
    state: ReplicaState = request.app.state.replica
    return state


def access_record(request: Request) -> dict[str, Any]:
    """The per-request record the access-log middleware writes out."""
    info: dict[str, Any] = request.scope.setdefault("state", {}).setdefault("access", {})
    return info
