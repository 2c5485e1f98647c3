"""Prometheus collectors of one replica, on a registry of its own (several apps may share a
process in tests). Gauges read the gate and the probe at scrape time."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)

CONTENT_TYPE = CONTENT_TYPE_LATEST


class ReplicaMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        p = "gpupool_replica_"
        self.requests = Counter(
            p + "requests",
            "Requests answered, by route and status",
            ["route", "status"],
            registry=r,
        )
        self.request_duration = Histogram(
            p + "request_duration_seconds",
            "Time from arrival to the last byte, by route",
            ["route"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_wait = Histogram(
            p + "queue_wait_seconds",
            "Time admitted requests waited for a slot",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            p + "time_to_first_token_seconds",
            "Time from arrival to the first generated event",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.rejections = Counter(
            p + "rejections",
            "Requests turned away before running, by reason",
            ["reason"],
            registry=r,
        )
        self.errors = Counter(p + "errors", "Error answers, by status", ["status"], registry=r)
        self.prompt_tokens = Counter(p + "prompt_tokens", "Prompt tokens processed", registry=r)
        self.completion_tokens = Counter(
            p + "completion_tokens", "Completion tokens generated", registry=r
        )
        self.in_flight = Gauge(p + "in_flight", "Requests inside the engine", registry=r)
        self.queued = Gauge(p + "queued", "Requests waiting for a slot", registry=r)
        self.ready = Gauge(p + "ready", "1 when the replica takes requests", registry=r)
        self.peak_memory = Gauge(
            p + "peak_memory_bytes", "Peak device memory allocated (engine's view)", registry=r
        )
        self.memory_used = Gauge(
            p + "memory_used_bytes", "Device memory used (NVML or simulated)", registry=r
        )
        self.memory_total = Gauge(
            p + "memory_total_bytes", "Device memory total (NVML or simulated)", registry=r
        )

    def bind(
        self,
        *,
        in_flight: Callable[[], float],
        queued: Callable[[], float],
        ready: Callable[[], float],
        peak_memory: Callable[[], float],
        memory_used: Callable[[], float],
        memory_total: Callable[[], float],
    ) -> None:
        """Gauges read live values at scrape time."""
        self.in_flight.set_function(in_flight)
        self.queued.set_function(queued)
        self.ready.set_function(ready)
        self.peak_memory.set_function(peak_memory)
        self.memory_used.set_function(memory_used)
        self.memory_total.set_function(memory_total)

    def render(self) -> bytes:
        return generate_latest(self.registry)
