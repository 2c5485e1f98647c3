"""Write a ladder's results: ``results.json``, ``results.csv``, ``ladder.png``, a rich table.

JSON holds everything (the run's settings and every level's full summary); CSV holds one flat
row per level with the same counts; the PNG plots throughput, p99 latency and peak memory
against concurrency.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.table import Table

from bench.stats import LevelSummary

if TYPE_CHECKING:
    from matplotlib.figure import Figure

CSV_FIXED = (
    "concurrency",
    "requests",
    "ok",
    "rejected",
    "failed",
    "oom",
    "failed_by_status",
    "duration_s",
    "request_rate",
    "output_token_rate",
    "mean_prompt_tokens",
    "mean_output_tokens",
)
METRICS = ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms", "queue_wait_ms")
QUANTILES = ("p50", "p90", "p99")


def csv_rows(levels: Sequence[LevelSummary]) -> list[dict[str, Any]]:
    replicas = sorted({name for level in levels for name in level.memory})
    rows = []
    for level in levels:
        row: dict[str, Any] = {k: getattr(level, k) for k in CSV_FIXED}
        row["failed_by_status"] = ";".join(f"{k}:{v}" for k, v in level.failed_by_status.items())
        for metric in METRICS:
            pct = getattr(level, metric)
            for q in QUANTILES:
                row[f"{metric.removesuffix('_ms')}_{q}_ms"] = getattr(pct, q) if pct else None
        row["goodput"] = level.goodput
        row["goodput_rate"] = level.goodput_rate
        row["peak_memory_mb"] = level.peak_memory_mb
        for name in replicas:
            m = level.memory.get(name)
            row[f"peak_memory_mb[{name}]"] = m.peak_mb if m else None
        rows.append(row)
    return rows


def write_csv(path: Path, levels: Sequence[LevelSummary]) -> None:
    rows = csv_rows(levels)
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]) if rows else list(CSV_FIXED))
        writer.writeheader()
        for row in rows:
            writer.writerow({k: ("" if v is None else v) for k, v in row.items()})


def write_json(path: Path, settings: Mapping[str, Any], levels: Sequence[LevelSummary]) -> None:
    data = {"settings": dict(settings), "levels": [lv.model_dump(mode="json") for lv in levels]}
    path.write_text(json.dumps(data, indent=2) + "\n")


def figure(levels: Sequence[LevelSummary], title: str = "gpupool ladder") -> Figure:
    """Throughput, p99 latency and peak memory per replica against concurrency.

    Throughput and memory axes start at zero, so a flat line looks flat; latency is on a log
    scale, so TPOT (ms) and E2E (s) are both readable.
    """
    from matplotlib.figure import Figure
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    x = [lv.concurrency for lv in levels]
    fig = Figure(figsize=(15, 4.2))
    axes = fig.subplots(1, 3)
    ax = axes[0]
    (req,) = ax.plot(x, [lv.request_rate for lv in levels], "o-", label="requests/s (left)")
    ax.set_ylabel("requests/s (ok)")
    tok = ax.twinx()
    (tps,) = tok.plot(
        x,
        [lv.output_token_rate for lv in levels],
        "s--",
        color="tab:orange",
        label="output tokens/s (right)",
    )
    tok.set_ylabel("output tokens/s", color="tab:orange")
    for axis in (ax, tok):
        axis.set_ylim(bottom=0, top=max(1e-9, axis.get_ylim()[1]) * 1.1)
    ax.legend(handles=[req, tps], fontsize="small", loc="lower right")
    ax.set_title("throughput")
    ax = axes[1]
    for metric, label in (("ttft_ms", "p99 TTFT"), ("e2e_ms", "p99 E2E"), ("tpot_ms", "p99 TPOT")):
        ys = [getattr(lv, metric).p99 for lv in levels]
        if any(y is not None and y > 0 for y in ys):
            ax.plot(x, [float("nan") if y is None else y for y in ys], "o-", label=label)
    if ax.lines:
        ax.set_yscale("log")
        ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.yaxis.set_minor_formatter(NullFormatter())
        ax.legend(fontsize="small")
    ax.set_ylabel("ms (log scale)")
    ax.set_title("p99 latency")
    ax = axes[2]
    names = sorted({name for lv in levels for name in lv.memory})
    for name in names:
        ys = [lv.memory[name].peak_mb if name in lv.memory else None for lv in levels]
        ax.plot(x, [float("nan") if y is None else y for y in ys], "o-", label=name)
    totals = [m.total_mb for lv in levels for m in lv.memory.values() if m.total_mb is not None]
    if totals:
        ax.axhline(min(totals), color="tab:red", linestyle=":", label="device total")
    if not names or all(lv.peak_memory_mb is None for lv in levels):
        ax.text(0.5, 0.5, "no memory reported", ha="center", va="center", transform=ax.transAxes)
    else:
        ax.set_ylim(bottom=0, top=ax.get_ylim()[1] * 1.1)
        ax.legend(fontsize="small", loc="best")
    ax.set_ylabel("MiB")
    ax.set_title("peak memory per replica")
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xticks(x, [str(c) for c in x])
        ax.minorticks_off()
        ax.set_xlabel("concurrency (clients)")
        ax.grid(True, alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def write_png(path: Path, levels: Sequence[LevelSummary], title: str = "gpupool ladder") -> None:
    figure(levels, title).savefig(path, dpi=100)


def fmt(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def table(levels: Sequence[LevelSummary], title: str = "ladder") -> Table:
    t = Table(title=title)
    for header in (
        "conc", "ok", "429", "failed", "req/s", "tok/s", "TTFT p50/p99 ms", "TPOT p50/p99 ms",
        "E2E p50/p99 ms", "queue mean ms", "goodput", "peak MiB",
    ):  # fmt: skip
        t.add_column(header, justify="right", overflow="fold")  # never "…" in place of a figure
    for lv in levels:
        failed = ", ".join(f"{k}:{v}" for k, v in lv.failed_by_status.items()) or "0"
        t.add_row(
            str(lv.concurrency),
            str(lv.ok),
            str(lv.rejected),
            failed,
            fmt(lv.request_rate, 2),
            fmt(lv.output_token_rate, 1),
            f"{fmt(lv.ttft_ms.p50)}/{fmt(lv.ttft_ms.p99)}",
            f"{fmt(lv.tpot_ms.p50, 1)}/{fmt(lv.tpot_ms.p99, 1)}",
            f"{fmt(lv.e2e_ms.p50)}/{fmt(lv.e2e_ms.p99)}",
            fmt(lv.queue_wait_ms.mean) if lv.queue_wait_ms else "-",
            "-" if lv.goodput is None else f"{lv.goodput:.0%}",
            fmt(lv.peak_memory_mb),
        )
    return t


def markdown_table(levels: Sequence[LevelSummary]) -> str:
    """The same figures as ``table`` in GitHub markdown (for docs)."""
    t = table(levels)
    headers = [str(c.header) for c in t.columns]
    cells = [list(c.cells) for c in t.columns]
    lines = ["| " + " | ".join(headers) + " |", "|" + "---:|" * len(headers)]
    for i in range(len(levels)):
        lines.append("| " + " | ".join(str(col[i]) for col in cells) + " |")
    return "\n".join(lines) + "\n"
