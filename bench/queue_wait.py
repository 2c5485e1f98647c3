"""Queue wait of a level from the replica's ``/metrics``: the change of its histogram.

A replica exports ``gpupool_replica_queue_wait_seconds`` (time admitted requests waited for a
slot). Reading it before and after a level gives that level's count and exact mean; percentiles
are estimated inside the histogram buckets as Prometheus' ``histogram_quantile`` does (linear
within a bucket), so they are only as fine as the buckets. Behind a router each replica's own
/metrics is read and the deltas pooled; where none can be read queue wait is "not available".
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families

from bench.stats import Percentiles

METRIC = "gpupool_replica_queue_wait_seconds"


@dataclass(frozen=True)
class Histogram:
    buckets: tuple[tuple[float, float], ...]  # (upper bound, cumulative count), ascending
    sum: float
    count: float

    def plus(self, other: Histogram) -> Histogram:
        theirs = dict(other.buckets)
        bounds = sorted({le for le, _ in self.buckets} | set(theirs))
        mine = dict(self.buckets)
        return Histogram(
            buckets=tuple((le, mine.get(le, 0.0) + theirs.get(le, 0.0)) for le in bounds),
            sum=self.sum + other.sum,
            count=self.count + other.count,
        )

    def minus(self, before: Histogram) -> Histogram:
        earlier = dict(before.buckets)
        return Histogram(
            buckets=tuple((le, c - earlier.get(le, 0.0)) for le, c in self.buckets),
            sum=self.sum - before.sum,
            count=self.count - before.count,
        )


def parse(text: str, name: str = METRIC) -> Histogram | None:
    """The histogram ``name`` from Prometheus text (summed over label sets), or None."""
    buckets: dict[float, float] = {}
    total = count = 0.0
    found = False
    try:
        families = list(text_string_to_metric_families(text))
    except ValueError:
        return None
    for family in families:
        if family.name != name:
            continue
        for sample in family.samples:
            found = True
            if sample.name == name + "_bucket":
                le = float(sample.labels["le"])
                buckets[le] = buckets.get(le, 0.0) + sample.value
            elif sample.name == name + "_sum":
                total += sample.value
            elif sample.name == name + "_count":
                count += sample.value
    if not found:
        return None
    return Histogram(buckets=tuple(sorted(buckets.items())), sum=total, count=count)


def quantile(h: Histogram, q: float) -> float | None:
    """Estimate the q-quantile (0..1) like Prometheus' histogram_quantile; None if empty."""
    if h.count <= 0 or not h.buckets:
        return None
    rank = q * h.count
    lower, below = 0.0, 0.0
    for upper, cumulative in h.buckets:
        if cumulative >= rank:
            if math.isinf(upper):
                return lower
            in_bucket = cumulative - below
            share = (rank - below) / in_bucket if in_bucket > 0 else 1.0
            return lower + (upper - lower) * share
        lower, below = upper, cumulative
    return lower


def percentiles(h: Histogram) -> Percentiles | None:
    """The level's queue wait in ms; None when no request was admitted."""
    if h.count <= 0:
        return None

    def ms(value: float | None) -> float | None:
        return None if value is None else value * 1000.0

    return Percentiles(
        count=int(h.count),
        mean=h.sum / h.count * 1000.0,
        p50=ms(quantile(h, 0.50)),
        p90=ms(quantile(h, 0.90)),
        p99=ms(quantile(h, 0.99)),
    )


async def read(
    client: httpx.AsyncClient, base_url: str, headers: dict[str, str] | None = None
) -> Histogram | None:
    """One replica's queue-wait histogram now, or None (no /metrics, or not a replica's)."""
    try:
        r = await client.get(base_url.rstrip("/") + "/metrics", timeout=5.0, headers=headers)
    except httpx.HTTPError:
        return None
    if r.status_code != 200:
        return None
    return parse(r.text)


async def read_all(
    client: httpx.AsyncClient, urls: dict[str, str], headers: dict[str, str] | None = None
) -> dict[str, Histogram]:
    """The histograms of every replica that has one, by name."""
    names = list(urls)
    found = await asyncio.gather(*(read(client, urls[n], headers) for n in names))
    return {n: h for n, h in zip(names, found, strict=True) if h is not None}


def level_percentiles(
    before: dict[str, Histogram], after: dict[str, Histogram]
) -> Percentiles | None:
    """Queue wait over a level, pooled over the replicas read at both ends."""
    deltas = [after[n].minus(before[n]) for n in after if n in before]
    if not deltas:
        return None
    pooled = deltas[0]
    for d in deltas[1:]:
        pooled = pooled.plus(d)
    return percentiles(pooled)
