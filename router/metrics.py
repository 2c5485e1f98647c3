"""Prometheus collectors of one router app (a registry per app, so tests do not collide).

Per-replica gauges and counters are read from the pool at scrape time (no cost on the request
path); request, retry and rejection counters and the upstream latency histogram are updated
by the proxy.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from router.pool import Pool

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class _PoolCollector(Collector):
    def __init__(self, pool: Pool, in_flight: Callable[[], int]) -> None:
        self._pool = pool
        self._in_flight = in_flight

    def collect(self) -> Iterator[Metric]:
        replicas = self._pool.list()
        total = GaugeMetricFamily("gpupool_router_in_flight", "Requests the router is serving now")
        total.add_metric([], self._in_flight())
        yield total
        gauges = {
            "in_flight": ("Requests the router has in flight at the replica", "in_flight"),
            "load": ("Estimated (in-flight + queued) / max_concurrency", "load"),
            "healthy": ("1 if the replica is healthy and ready", None),
        }
        for key, (doc, attr) in gauges.items():
            family = GaugeMetricFamily(f"gpupool_router_replica_{key}", doc, labels=["replica"])
            for r in replicas:
                value = float(getattr(r, attr)) if attr else float(r.accepting)
                family.add_metric([r.name], value)
            yield family
        counters = {
            "picks": "Requests sent to the replica (each attempt)",
            "ejections": "Times the replica was taken out of rotation",
            "errors": "Failed attempts at the replica (connection errors and 5xx)",
        }
        for key, doc in counters.items():
            family_c = CounterMetricFamily(f"gpupool_router_replica_{key}", doc, labels=["replica"])
            for r in replicas:
                family_c.add_metric([r.name], float(getattr(r, key)))
            yield family_c


class RouterMetrics:
    def __init__(self, pool: Pool, in_flight: Callable[[], int]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(_PoolCollector(pool, in_flight))
        self.requests = Counter(
            "gpupool_router_requests",
            "Proxied requests by final status",
            ["status"],
            registry=self.registry,
        )
        self.retries = Counter(
            "gpupool_router_retries",
            "Attempts retried on another replica, by reason",
            ["reason"],
            registry=self.registry,
        )
        self.rejections = Counter(
            "gpupool_router_rejections",
            "Requests the router answered itself without a replica, by reason",
            ["reason"],
            registry=self.registry,
        )
        self.upstream_latency = Histogram(
            "gpupool_router_upstream_latency_seconds",
            "Time from sending to a replica until its response headers",
            ["replica"],
            registry=self.registry,
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)
