"""Ladder outputs: JSON, CSV and PNG agree; tune's YAML write-back changes one value only."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

import pytest

from bench import report
from bench.stats import LevelInput, LevelSummary, ReplicaMemory, RequestResult, summarize
from bench.yaml_edit import YamlEditError, set_max_concurrency
from common.config import load_config


def level(concurrency: int, oks: int, rejected: int) -> LevelSummary:
    results = [
        RequestResult(
            status=200, ok=True, ttft_s=0.1, latency_s=0.2, output_tokens=4, streamed=True
        )
        for _ in range(oks)
    ] + [RequestResult(status=429) for _ in range(rejected)]
    memory = {"gpu0": ReplicaMemory(peak_used_mb=100.0 * concurrency, total_mb=1000.0, samples=3)}
    return summarize(LevelInput(concurrency, results, duration_s=1.0, memory=memory))


def test_json_csv_png_agree(tmp_path: Path) -> None:
    levels = [level(1, 5, 0), level(2, 8, 0), level(4, 8, 3)]
    report.write_json(tmp_path / "results.json", {"url": "http://x"}, levels)
    report.write_csv(tmp_path / "results.csv", levels)
    report.write_png(tmp_path / "ladder.png", levels)
    data = json.loads((tmp_path / "results.json").read_text())
    rows = list(csv.DictReader((tmp_path / "results.csv").open()))
    assert [lv["concurrency"] for lv in data["levels"]] == [1, 2, 4]
    assert [int(r["concurrency"]) for r in rows] == [1, 2, 4]
    for lv, row in zip(data["levels"], rows, strict=True):
        for key in ("requests", "ok", "rejected", "failed"):
            assert int(row[key]) == lv[key]
    assert rows[2]["rejected"] == "3"
    assert float(rows[1]["peak_memory_mb[gpu0]"]) == 200.0
    assert (tmp_path / "ladder.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = report.markdown_table(levels)
    assert md.count("\n") == 2 + len(levels)


CONFIG = """\
# Tuned by measurement.
model:
  source: simulated:decode_ms=5   # no torch
  max_new_tokens: 64

replicas:
  devices: [cpu, cpu]
  # the semaphore
  max_concurrency: 1    # start at 1
  max_queue: 8
"""


def test_write_back_changes_only_the_value(tmp_path: Path) -> None:
    f = tmp_path / "c.yaml"
    f.write_text(CONFIG)
    assert set_max_concurrency(f, 6) == "1"
    after = f.read_text()
    changed = [
        (a, b) for a, b in zip(CONFIG.splitlines(), after.splitlines(), strict=True) if a != b
    ]
    assert changed == [
        ("  max_concurrency: 1    # start at 1", "  max_concurrency: 6    # start at 1")
    ]
    assert load_config(f).replicas.max_concurrency == 6


def test_write_back_adds_a_missing_key_keeping_comments(tmp_path: Path) -> None:
    f = tmp_path / "c.yaml"
    f.write_text(CONFIG.replace("  max_concurrency: 1    # start at 1\n", ""))
    set_max_concurrency(f, 3)
    text = f.read_text()
    assert "# Tuned by measurement." in text and "# no torch" in text
    assert load_config(f).replicas.max_concurrency == 3
    with pytest.raises(YamlEditError):
        set_max_concurrency(f, 0)
    f.write_text("- a list\n")
    with pytest.raises(YamlEditError, match="not a mapping"):
        set_max_concurrency(f, 2)


@pytest.mark.parametrize(
    ("before", "added", "new_lines"),
    [
        # Sequences not indented under their key, 4-space indents, long lines: all kept.
        (
            "model:\n    source: builtin:tiny-random   # m\nreplicas:\n    devices:\n    - cpu\n"
            "    - cpu\n    max_queue: 4   # q\n",
            "replicas:\n    max_concurrency: 5\n",
            1,
        ),
        (
            "model:\n  source: simulated:decode_ms=5,prefill_ms=0,weights_mb=500,"
            "kv_kb_per_token=600,total_mb=1000\nreplicas:\n  devices: [cpu, cpu, cpu, cpu, cpu, "
            "cpu, cpu, cpu, cpu, cpu, cpu, cpu, cpu, cpu, cpu, cpu]\n",
            "replicas:\n  max_concurrency: 5\n",
            1,
        ),
        # No replicas block at all, and no final newline.
        ("# top\nmodel:\n  source: builtin:tiny-random", "replicas:\n  max_concurrency: 5\n", 2),
        # Windows line ends.
        (
            "model:\r\n  source: x\r\nreplicas:\r\n  devices: [cpu]\r\n",
            "  max_concurrency: 5\r\n",
            1,
        ),
    ],
)
def test_write_back_of_a_missing_key_only_adds_lines(
    tmp_path: Path, before: str, added: str, new_lines: int
) -> None:
    f = tmp_path / "c.yaml"
    f.write_bytes(before.encode())
    assert set_max_concurrency(f, 5) == ""
    after = f.read_bytes().decode()
    # Every line of the file is still there, in order and byte for byte; only new lines came in.
    kept = iter(after.splitlines(keepends=True))
    for line in before.splitlines(keepends=True):
        assert any(line.rstrip("\r\n") == other.rstrip("\r\n") for other in kept), line
    assert added in after
    assert len(after.splitlines()) == len(before.splitlines()) + new_lines


def test_write_back_refuses_what_it_cannot_place(tmp_path: Path) -> None:
    f = tmp_path / "c.yaml"
    for text in ("replicas: null\n", "replicas:\n  max_concurrency: &n 3\n"):
        f.write_text(text)
        with pytest.raises(YamlEditError, match="set it by hand"):
            set_max_concurrency(f, 4)
        assert f.read_text() == text


def test_plot_axes_start_at_zero_so_a_flat_throughput_looks_flat() -> None:
    # Throughput 0.44 .. 0.46 req/s: an axis fitted to the data would show a steep climb.
    levels = [level(c, 44 + c // 4, 0) for c in (1, 2, 4, 8)]
    throughput, latency, memory = report.figure(levels).axes[:3]
    assert throughput.get_ylim()[0] == 0 and memory.get_ylim()[0] == 0
    assert throughput.get_ylim()[1] > max(lv.request_rate for lv in levels)
    legend, memory_legend = throughput.get_legend(), memory.get_legend()
    assert legend is not None and memory_legend is not None
    assert len(legend.get_texts()) == 2  # requests/s and tokens/s, told apart
    assert latency.get_yscale() == "log"  # TPOT (ms) and E2E (s) both readable
    assert "device total" in [t.get_text() for t in memory_legend.get_texts()]


def test_the_table_never_hides_a_figure_in_a_narrow_terminal() -> None:
    from rich.console import Console

    console = Console(width=80, record=True, file=io.StringIO())
    console.print(report.table([level(1, 5, 0), level(16, 8, 3)]))
    text = console.export_text()
    assert "…" not in text
