"""Ladder inputs: prompt datasets and lengths, queue-wait histograms, router /replicas shapes."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import queue_wait
from bench.memory import parse_replicas
from bench.workload import WorkloadError, generate, load_dataset, parse_token_range


def test_token_ranges() -> None:
    assert parse_token_range("200") == (200, 200)
    assert parse_token_range("100:300") == (100, 300)
    for bad in ("", "x", "0", "300:100", "1:2:3"):
        with pytest.raises(WorkloadError, match="--prompt-tokens"):
            parse_token_range(bad)


def test_generated_prompts_are_reproducible_and_sized() -> None:
    a = generate(20, (30, 60), seed=7)
    assert a == generate(20, (30, 60), seed=7)
    assert a != generate(20, (30, 60), seed=8)
    lengths = [len((p.text or "").split()) for p in a]
    assert all(30 <= n <= 60 for n in lengths)
    assert len(set(lengths)) > 1  # a range, not one length


def test_generated_prompts_are_bounded_whatever_the_request_count() -> None:
    assert 1 <= len(generate(10**12, (128, 128), seed=0)) <= 1024
    assert len(generate(10**12, (100_000, 100_000), seed=0)) <= 40  # 4M words at most


def test_dataset_lines_and_payloads(tmp_path: Path) -> None:
    f = tmp_path / "d.jsonl"
    f.write_text(
        '{"prompt": "Hello there"}\n\n'
        '{"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 7}\n'
    )
    text, chat = load_dataset(f)
    assert text.payload("completions") == {"prompt": "Hello there"}
    assert text.payload("chat") == {"messages": [{"role": "user", "content": "Hello there"}]}
    assert chat.payload("chat") == {"messages": [{"role": "user", "content": "Hi"}]}
    assert chat.payload("completions") == {"prompt": "user: Hi"}
    assert chat.max_tokens == 7


@pytest.mark.parametrize(
    "line",
    [
        '{"text": "no"}',
        "[1, 2]",
        "not json",
        '{"prompt": "x", "max_tokens": 0}',
        '{"prompt": "x", "max_tokens": true}',
        '{"messages": [{"role": "user"}]}',
    ],
)
def test_bad_dataset_lines_are_named(tmp_path: Path, line: str) -> None:
    f = tmp_path / "bad.jsonl"
    f.write_text('{"prompt": "fine"}\n' + line + "\n")
    with pytest.raises(WorkloadError, match=r"bad\.jsonl:2"):
        load_dataset(f)


METRICS = """\
# HELP gpupool_replica_queue_wait_seconds Time admitted requests waited for a slot
# TYPE gpupool_replica_queue_wait_seconds histogram
gpupool_replica_queue_wait_seconds_bucket{le="0.01"} %d
gpupool_replica_queue_wait_seconds_bucket{le="0.1"} %d
gpupool_replica_queue_wait_seconds_bucket{le="+Inf"} %d
gpupool_replica_queue_wait_seconds_count %d
gpupool_replica_queue_wait_seconds_sum %f
"""


def test_queue_wait_from_histogram_deltas() -> None:
    before = queue_wait.parse(METRICS % (5, 5, 5, 5, 0.01))
    # Since then: 10 more requests, 5 waited under 10 ms, 5 between 10 and 100 ms, 0.3 s in all.
    after = queue_wait.parse(METRICS % (10, 15, 15, 15, 0.31))
    assert before is not None and after is not None
    level = queue_wait.percentiles(after.minus(before))
    assert level is not None
    assert level.count == 10
    assert level.mean == pytest.approx(30.0)
    assert level.p50 == pytest.approx(10.0)  # the edge of the first bucket
    assert 10.0 < (level.p90 or 0) <= 100.0
    assert queue_wait.parse("# nothing here\n") is None


def test_router_replicas_shapes() -> None:
    health = {"memory": {"used_bytes": 2 << 20, "total_bytes": 8 << 20, "free_bytes": 6 << 20},
              "peak_memory_bytes": 3 << 20}  # fmt: skip
    for body in (
        [{"name": "a", "health": health}],
        {"replicas": [{"name": "a", **health}]},
        {"replicas": {"a": {"last_health": health}}},
    ):
        assert parse_replicas(body) == {"a": (2.0, 8.0, 3.0)}
    assert parse_replicas({"replicas": [{"name": "cpu0", "memory": None}]}) == {
        "cpu0": (None, None, None)
    }
