"""bench.stats: percentiles, TPOT/ITL/goodput as vllm bench serve defines them, level summaries."""

from __future__ import annotations

import numpy as np
import pytest

from bench.stats import (
    LevelInput,
    RequestResult,
    Slo,
    meets_slo,
    percentile,
    summarize,
)


def ok(ttft: float, latency: float, tokens: int, gaps: tuple[float, ...] = ()) -> RequestResult:
    return RequestResult(
        status=200,
        ok=True,
        ttft_s=ttft,
        latency_s=latency,
        output_tokens=tokens,
        itl_s=gaps,
        streamed=True,
    )


@pytest.mark.parametrize("p", [0, 10, 50, 90, 99, 100])
def test_percentile_matches_numpy(p: float) -> None:
    values = [0.3, 12.0, 5.5, 7.25, 1.0, 99.0, 42.0]
    assert percentile(values, p) == pytest.approx(float(np.percentile(values, p)))


def test_percentile_of_nothing_is_none_and_bad_p_is_refused() -> None:
    assert percentile([], 50) is None
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_tpot_excludes_the_first_token() -> None:
    # 1 s to the first token, then 9 more tokens over 0.9 s: 100 ms per output token.
    assert ok(1.0, 1.9, 10).tpot_s == pytest.approx(0.1)
    assert ok(1.0, 1.0, 1).tpot_s is None  # one token: no TPOT
    plain = RequestResult(status=200, ok=True, ttft_s=2.0, latency_s=2.0, output_tokens=10)
    assert plain.tpot_s is None  # not streamed: no token timing


def test_slo_checks_every_given_metric() -> None:
    r = ok(0.2, 1.1, 10)  # TTFT 200 ms, E2E 1100 ms, TPOT 100 ms
    assert meets_slo(r, Slo(ttft_ms=250, e2e_ms=1200, tpot_ms=101))
    assert not meets_slo(r, Slo(ttft_ms=150))
    assert not meets_slo(r, Slo(e2e_ms=1000))
    assert not meets_slo(r, Slo(tpot_ms=99))
    # vllm: a one-token answer counts as TPOT 0 for goodput.
    assert meets_slo(ok(0.1, 0.1, 1), Slo(tpot_ms=1))
    assert not meets_slo(RequestResult(status=429), Slo(ttft_ms=1e9))


def test_summary_counts_rates_and_goodput() -> None:
    results = [
        ok(0.1, 0.5, 5, (0.1, 0.1, 0.1, 0.1)),
        ok(0.3, 0.7, 5, (0.1, 0.1, 0.1, 0.1)),
        RequestResult(status=429, error="queue full"),
        RequestResult(status=503, error="out of device memory", oom=True),
        RequestResult(status=None, error="timeout"),
    ]
    s = summarize(LevelInput(concurrency=4, results=results, duration_s=2.0, slo=Slo(ttft_ms=200)))
    assert (s.requests, s.ok, s.rejected, s.failed, s.oom) == (5, 2, 1, 2, 1)
    assert s.failed_by_status == {"503": 1, "timeout": 1}
    assert s.request_rate == pytest.approx(1.0)  # 2 ok in 2 s
    assert s.output_token_rate == pytest.approx(5.0)
    assert s.itl_ms.count == 8 and s.itl_ms.p50 == pytest.approx(100.0)
    assert s.e2e_ms.p50 == pytest.approx(600.0)
    # Only the first request meets TTFT <= 200 ms; rejections and errors count against goodput.
    assert s.goodput == pytest.approx(1 / 5)
    assert s.goodput_rate == pytest.approx(0.5)


def test_no_slo_means_no_goodput_and_no_samples_means_none() -> None:
    s = summarize(LevelInput(concurrency=1, results=[RequestResult(status=429)], duration_s=1.0))
    assert s.goodput is None
    assert s.ttft_ms.p99 is None and s.ok == 0 and s.rejected == 1
    assert s.queue_wait_ms is None
