"""Pure computations of a ladder: per-request results in, one summary per level out.

Definitions follow ``vllm bench serve`` (``vllm/benchmarks/serve.py`` and its request functions)
so figures compare with that tool's:

- TTFT: request sent -> first stream event carrying generated text. (vllm takes the first event
  with any choice; vLLM and our replica send the chat role chunk together with the first token,
  so the two agree, and a server that sends its role preamble early is not credited for it.)
  Without ``--stream`` the client sees nothing before the whole answer, so TTFT equals E2E there.
- E2E: request sent -> the last stream event carrying a choice (the last token or the finish
  reason), as vllm; the trailing usage event and ``[DONE]`` do not count. Without ``--stream``:
  the whole response. A 200 stream that never carries a choice is a failure (``no_chunks``).
- TPOT: (E2E - TTFT) / (output_tokens - 1), only for requests with more than one output token
  (the first token is excluded); for goodput a request with <= 1 token has TPOT 0.
- ITL: every gap between successive events carrying text, pooled over all requests of the level.
- Goodput: requests that succeeded AND met every given SLO (metric <= SLO). vllm reports it as a
  rate (``goodput_rate`` here); we also report it as a share of ALL requests sent in the level, so
  rejections and errors count against it.

Percentiles interpolate linearly between order statistics (numpy's default), so p50/p90/p99
match ``numpy.percentile`` on the same samples.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from pydantic import BaseModel


@dataclass(frozen=True)
class RequestResult:
    """What one request did, as the client saw it. Times in seconds."""

    status: int | None  # HTTP status; None when no answer came (timeout, connection error)
    ok: bool = False
    error: str | None = None  # short reason for a failure: "timeout", "connect_error", a message
    ttft_s: float | None = None
    latency_s: float | None = None
    itl_s: tuple[float, ...] = ()
    output_tokens: int = 0
    prompt_tokens: int = 0
    oom: bool = False  # the server said it ran out of device memory
    streamed: bool = False  # token timing seen (TPOT and ITL exist only then)

    @property
    def rejected(self) -> bool:
        return self.status == 429

    @property
    def failure_key(self) -> str:
        """How failures are grouped: the HTTP status, or the transport error's name."""
        if self.status is not None:
            return str(self.status)
        return self.error or "error"

    @property
    def tpot_s(self) -> float | None:
        if not self.ok or not self.streamed or self.latency_s is None or self.ttft_s is None:
            return None
        if self.output_tokens <= 1:
            return None
        return (self.latency_s - self.ttft_s) / (self.output_tokens - 1)


@dataclass(frozen=True)
class Slo:
    """Service-level objectives in milliseconds; None means not checked."""

    ttft_ms: float | None = None
    e2e_ms: float | None = None
    tpot_ms: float | None = None

    @property
    def any(self) -> bool:
        return any(v is not None for v in (self.ttft_ms, self.e2e_ms, self.tpot_ms))


def meets_slo(result: RequestResult, slo: Slo) -> bool:
    """True when the request succeeded and every given SLO holds (as vllm: metric <= SLO)."""
    if not result.ok:
        return False
    checks: list[tuple[float | None, float | None]] = [
        (slo.ttft_ms, result.ttft_s),
        (slo.e2e_ms, result.latency_s),
        # vllm: a request with <= 1 output token has TPOT 0 for goodput.
        (slo.tpot_ms, result.tpot_s if result.tpot_s is not None else 0.0),
    ]
    for limit_ms, value_s in checks:
        if limit_ms is None:
            continue
        if value_s is None or value_s * 1000.0 > limit_ms:
            return False
    return True


def percentile(values: Sequence[float], p: float) -> float | None:
    """The p-th percentile (0..100) with linear interpolation; None for no samples."""
    if not values:
        return None
    if not 0.0 <= p <= 100.0:
        raise ValueError(f"percentile must be within 0..100, got {p}")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * p / 100.0
    low = math.floor(rank)
    high = math.ceil(rank)
    if low == high:
        return ordered[low]
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


class Percentiles(BaseModel):
    """One metric's distribution in milliseconds."""

    count: int
    mean: float | None
    p50: float | None
    p90: float | None
    p99: float | None

    @classmethod
    def of_seconds(cls, values_s: Iterable[float]) -> Percentiles:
        ms = [v * 1000.0 for v in values_s]
        return cls(
            count=len(ms),
            mean=sum(ms) / len(ms) if ms else None,
            p50=percentile(ms, 50),
            p90=percentile(ms, 90),
            p99=percentile(ms, 99),
        )


class ReplicaMemory(BaseModel):
    """Memory of one replica during one level, in MiB (None where the replica reports none)."""

    peak_used_mb: float | None = None  # max of /health memory.used over the level's samples
    total_mb: float | None = None
    reported_peak_mb: float | None = None  # max of /health peak_memory_bytes (process lifetime)
    samples: int = 0

    @property
    def peak_mb(self) -> float | None:
        """The highest figure we have: sampled use or the replica's own peak."""
        values = [v for v in (self.peak_used_mb, self.reported_peak_mb) if v is not None]
        return max(values) if values else None


class LevelSummary(BaseModel):
    concurrency: int
    requests: int
    ok: int
    rejected: int
    failed: int
    failed_by_status: dict[str, int] = {}
    oom: int = 0
    duration_s: float
    request_rate: float  # successful requests per second
    output_token_rate: float  # output tokens of successful requests per second
    mean_prompt_tokens: float | None = None
    mean_output_tokens: float | None = None
    ttft_ms: Percentiles
    tpot_ms: Percentiles
    itl_ms: Percentiles
    e2e_ms: Percentiles
    queue_wait_ms: Percentiles | None = None  # None: the server reports no queue wait
    queue_wait_source: str | None = None  # "metrics": the replicas' histogram around the level
    goodput: float | None = None  # share of all requests that met every SLO; None: no SLO
    goodput_rate: float | None = None  # such requests per second
    memory: dict[str, ReplicaMemory] = {}
    stopped_early: bool = False  # the level's hard time cap cut it short

    @property
    def peak_memory_mb(self) -> float | None:
        peaks = [m.peak_mb for m in self.memory.values() if m.peak_mb is not None]
        return max(peaks) if peaks else None


@dataclass
class LevelInput:
    """Everything ``summarize`` needs about one level."""

    concurrency: int
    results: Sequence[RequestResult]
    duration_s: float
    slo: Slo = field(default_factory=Slo)
    memory: Mapping[str, ReplicaMemory] = field(default_factory=dict)
    stopped_early: bool = False
    # Queue wait over the level from the replicas' /metrics (None: none reports it).
    queue_wait_from_metrics: Percentiles | None = None


def summarize(level: LevelInput) -> LevelSummary:
    results = level.results
    good = [r for r in results if r.ok]
    rejected = sum(1 for r in results if not r.ok and r.rejected)
    failures = Counter(r.failure_key for r in results if not r.ok and not r.rejected)
    duration = max(level.duration_s, 1e-9)
    output_tokens = sum(r.output_tokens for r in good)
    queue_wait = level.queue_wait_from_metrics
    goodput: float | None = None
    goodput_rate: float | None = None
    if level.slo.any:
        met = sum(1 for r in results if meets_slo(r, level.slo))
        goodput = met / len(results) if results else 0.0
        goodput_rate = met / duration
    return LevelSummary(
        concurrency=level.concurrency,
        requests=len(results),
        ok=len(good),
        rejected=rejected,
        failed=sum(failures.values()),
        failed_by_status=dict(sorted(failures.items())),
        oom=sum(1 for r in results if r.oom),
        duration_s=level.duration_s,
        request_rate=len(good) / duration,
        output_token_rate=output_tokens / duration,
        mean_prompt_tokens=sum(r.prompt_tokens for r in good) / len(good) if good else None,
        mean_output_tokens=output_tokens / len(good) if good else None,
        ttft_ms=Percentiles.of_seconds(r.ttft_s for r in good if r.ttft_s is not None),
        tpot_ms=Percentiles.of_seconds(t for r in good if (t := r.tpot_s) is not None),
        itl_ms=Percentiles.of_seconds(gap for r in good for gap in r.itl_s),
        e2e_ms=Percentiles.of_seconds(r.latency_s for r in good if r.latency_s is not None),
        queue_wait_ms=queue_wait,
        queue_wait_source="metrics" if queue_wait is not None else None,
        goodput=goodput,
        goodput_rate=goodput_rate,
        memory=dict(level.memory),
        stopped_early=level.stopped_early,
    )
