"""Replica state as the router sees it, and the pool that holds it. State only: no I/O.

The poller writes what a replica reports; the proxy writes its own live counts and passive
failures; the policy reads. Everything runs on one event loop, so plain attributes suffice.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from common.protocol import HealthReport, MemoryInfo


@dataclass
class ReplicaState:
    name: str
    url: str
    # Capacity: from the deployment config at start, then from each report. A foreign replica
    # (no gpupool report) keeps the router's defaults.
    max_concurrency: int = 1
    max_queue: int = 32
    foreign: bool = False
    # Reachability, decided by the poller and by passive failures on real requests.
    healthy: bool = True
    # What the replica last said: ready to serve, draining. A new replica is not ready until
    # the first successful probe.
    ready: bool = False
    draining: bool = False
    # Set through the router's admin API: no new work, in-flight finishes.
    admin_drained: bool = False
    # Removed from membership (admin API, DNS): no new work; dropped once in_flight is 0.
    removing: bool = False
    # The router's own live count of requests it has sent there and not yet finished.
    in_flight: int = 0
    # The last report: in-flight and queued at the replica (from every client), and memory.
    reported_in_flight: int = 0
    reported_queued: int = 0
    # The router's own in_flight when that report arrived (see ``estimated_load``).
    own_at_report: int = 0
    memory: MemoryInfo | None = None
    model: str | None = None
    device: str | None = None
    completed: int | None = None
    last_report_at: float | None = None
    # Counters and streaks.
    consecutive_failures: int = 0
    consecutive_successes: int = 0
    consecutive_5xx: int = 0
    # A replica ejected for answering 5xx stays out until this time (monotonic clock), even
    # when its /health looks fine.
    ejected_until: float = 0.0
    error_ejections: int = 0
    last_error: str | None = None
    ejections: int = 0
    picks: int = 0
    errors: int = 0

    @property
    def capacity(self) -> int:
        """Requests the replica holds at once: running plus waiting."""
        return self.max_concurrency + self.max_queue

    @property
    def outstanding(self) -> int:
        """Best estimate of requests at the replica now (running + queued, from every client).

        Merge rule: the report is a snapshot of everything at the replica; the router's own
        count is live but sees only its own requests. Requests from others at report time are
        ``reported - own_at_report`` (never negative); they are assumed to stay until the next
        report, and the router's own live count is added on top. So between polls the estimate
        moves with every request the router sends or finishes, and each poll corrects it.
        """
        others = self.reported_in_flight + self.reported_queued - self.own_at_report
        return self.in_flight + max(others, 0)

    @property
    def load(self) -> float:
        """(in-flight + queued) / max_concurrency: 1.0 means every slot busy."""
        return self.outstanding / self.max_concurrency

    @property
    def accepting(self) -> bool:
        """Whether the replica takes new work at all (memory and fullness aside)."""
        return (
            self.healthy
            and self.ready
            and not self.draining
            and not self.admin_drained
            and not self.removing
        )

    def apply_report(self, report: HealthReport, now: float) -> None:
        self.foreign = False
        self.ready = report.ready
        self.draining = report.draining
        self.max_concurrency = report.max_concurrency
        self.max_queue = report.max_queue
        self.reported_in_flight = report.in_flight
        self.reported_queued = report.queued
        self.own_at_report = self.in_flight
        self.memory = report.memory
        self.model = report.model
        self.device = report.device
        self.completed = report.completed
        self.last_report_at = now

    def apply_foreign(self, now: float, max_concurrency: int, max_queue: int) -> None:
        """A /health that answered 200 without a gpupool report (vLLM, TGI...)."""
        self.foreign = True
        self.ready = True
        self.draining = False
        self.max_concurrency = max_concurrency
        self.max_queue = max_queue
        self.reported_in_flight = self.reported_queued = self.own_at_report = 0
        self.memory = None
        self.last_report_at = now

    def snapshot(self) -> dict[str, Any]:
        """The JSON shape of ``GET /replicas``."""
        return {
            "name": self.name,
            "url": self.url,
            "state": self.state,
            "healthy": self.healthy,
            "ready": self.ready,
            "draining": self.draining,
            "admin_drained": self.admin_drained,
            "removing": self.removing,
            "foreign": self.foreign,
            "in_flight": self.in_flight,
            "reported_in_flight": self.reported_in_flight,
            "reported_queued": self.reported_queued,
            "max_concurrency": self.max_concurrency,
            "max_queue": self.max_queue,
            "load": round(self.load, 4),
            "memory": self.memory.model_dump() if self.memory else None,
            "model": self.model,
            "device": self.device,
            "picks": self.picks,
            "errors": self.errors,
            "ejections": self.ejections,
            "consecutive_failures": self.consecutive_failures,
            "last_error": self.last_error,
            "last_report_at": self.last_report_at,
        }

    @property
    def state(self) -> str:
        """One word for tables: removing, drained, unhealthy, draining, loading, ready."""
        if self.removing:
            return "removing"
        if self.admin_drained:
            return "drained"
        if not self.healthy:
            return "unhealthy"
        if self.draining:
            return "draining"
        if not self.ready:
            return "loading"
        return "ready"


@dataclass
class Pool:
    """Membership by name. Insertion order is kept (tables list replicas as configured)."""

    replicas: dict[str, ReplicaState] = field(default_factory=dict)

    def add(self, replica: ReplicaState) -> ReplicaState:
        existing = self.replicas.get(replica.name)
        if existing is not None and existing.removing:
            # Re-added before its in-flight finished: keep counts, take it back.
            existing.removing = False
            existing.url = replica.url
            return existing
        if existing is not None:
            raise KeyError(f"replica {replica.name!r} already exists")
        self.replicas[replica.name] = replica
        return replica

    def get(self, name: str) -> ReplicaState | None:
        return self.replicas.get(name)

    def remove(self, name: str) -> ReplicaState | None:
        """Take a replica out of rotation; it is dropped once its in-flight requests finish."""
        replica = self.replicas.get(name)
        if replica is None:
            return None
        replica.removing = True
        self.reap(replica)
        return replica

    def reap(self, replica: ReplicaState) -> None:
        """Drop a removed replica once nothing of the router's is in flight there."""
        if replica.removing and replica.in_flight == 0:
            self.replicas.pop(replica.name, None)

    def by_url(self, url: str) -> ReplicaState | None:
        for replica in self.replicas.values():
            if replica.url == url:
                return replica
        return None

    def list(self) -> list[ReplicaState]:
        return list(self.replicas.values())

    def __len__(self) -> int:
        return len(self.replicas)
