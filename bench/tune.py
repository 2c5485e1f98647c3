"""Find the largest safe ``max_concurrency``: ``python -m bench.tune CONFIG`` (``gpupool tune``).

For C = 1, 2, 4, ... (up to ``--up-to``) it starts ONE replica from the config with
``--max-concurrency C`` on a free loopback port, runs one ladder level of C closed-loop clients
against it, and stops the replica. It stops at the first step with an out-of-memory answer, any
failed or rejected (429) request, peak memory above (total - headroom), or a missed SLO
(goodput below ``--min-goodput``), and recommends the last step that passed, with the evidence
table.
``--write`` puts the value into the YAML's ``replicas.max_concurrency`` (comments kept).

With ``--url`` it starts nothing and cannot change the server's max_concurrency: it ladders the
CLIENT concurrency only and reports the largest level that passed; ``--write`` is refused then.
Exit status: 0 with a recommendation, 1 when even the first step failed or a replica would not
start, 2 for bad arguments, 130 when interrupted (Ctrl-C).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.table import Table

from bench import report
from bench.ladder import (
    UsageError,
    add_load_options,
    base_url,
    check_load_args,
    check_reachable,
    plan_from,
    prepare_out,
    resolve_model,
    slo_from,
)
from bench.replica_proc import ReplicaStartError, replica
from bench.runner import PromptCycle, make_client, run_level
from bench.stats import LevelSummary
from bench.workload import WorkloadError
from bench.yaml_edit import YamlEditError, set_max_concurrency
from common.config import ConfigError, DeploymentConfig, load_config
from common.gpu import list_gpus, pin_to_gpu


@dataclass
class Step:
    concurrency: int
    summary: LevelSummary
    limit_mb: float | None  # total - headroom, where the replica reports memory
    problem: str | None  # None: the step passed


def judge(
    summary: LevelSummary, headroom_mb: float, min_goodput: float
) -> tuple[str | None, float | None]:
    """Why a step fails (None if it passes), and the memory limit it was held to."""
    totals = [m.total_mb for m in summary.memory.values() if m.total_mb is not None]
    limit = min(totals) - headroom_mb if totals else None
    if summary.oom:
        return f"out of memory ({summary.oom} requests)", limit
    if summary.failed:
        failures = ", ".join(f"{k}: {v}" for k, v in summary.failed_by_status.items())
        return f"failed requests ({failures})", limit
    if summary.rejected:  # the server could not take this load (only seen with --url)
        return f"rejected requests (429: {summary.rejected})", limit
    peak = summary.peak_memory_mb
    if limit is not None and peak is not None and peak > limit:
        return f"memory {peak:.0f} MiB above total - headroom ({limit:.0f} MiB)", limit
    if summary.goodput is not None and summary.goodput < min_goodput:
        return f"missed SLO (goodput {summary.goodput:.0%} < {min_goodput:.0%})", limit
    if summary.ok == 0:
        return "no request succeeded", limit
    return None, limit


def steps_up_to(limit: int) -> list[int]:
    values, c = [], 1
    while c <= limit:
        values.append(c)
        c *= 2
    return values


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="gpupool tune",
        description="Find the largest safe replicas.max_concurrency under a load and an SLO "
        "(one fresh replica per step); --write puts it into the YAML.",
    )
    p.add_argument("config", nargs="?", type=Path, help="deployment YAML (optional with --url)")
    p.add_argument("--replica", default=None, help="which replica of the config (default: first)")
    p.add_argument(
        "--url", default=None, help="tune against a running server instead (observe only)"
    )
    p.add_argument(
        "--up-to", type=int, default=64, help="largest max_concurrency tried (default 64)"
    )
    p.add_argument(
        "--headroom-mb",
        type=float,
        default=None,
        help="memory to keep free (default: replicas.headroom_mb of the config, or 1024)",
    )
    p.add_argument(
        "--min-goodput",
        type=float,
        default=0.95,
        help="share of requests that must meet every SLO (default 0.95)",
    )
    p.add_argument(
        "--ready-timeout-s",
        type=float,
        default=600.0,
        help="how long a replica may take to load (default 600)",
    )
    p.add_argument("--write", action="store_true", help="write the value into CONFIG")
    p.add_argument(
        "--out", type=Path, default=None, help="also write tune.json, results.csv, ladder.png here"
    )
    add_load_options(p)
    return p


def evidence_table(steps: Sequence[Step], title: str) -> Table:
    t = Table(title=title)
    for h in (
        "max_conc",
        "ok",
        "429",
        "failed",
        "req/s",
        "tok/s",
        "TTFT p99",
        "TPOT p99",
        "E2E p99",
        "goodput",
        "peak MiB",
        "limit MiB",
        "verdict",
    ):
        t.add_column(h, justify="right", overflow="fold")
    f = report.fmt
    for s in steps:
        lv = s.summary
        t.add_row(
            str(s.concurrency),
            str(lv.ok),
            str(lv.rejected),
            str(lv.failed),
            f(lv.request_rate, 2),
            f(lv.output_token_rate, 1),
            f(lv.ttft_ms.p99),
            f(lv.tpot_ms.p99, 1),
            f(lv.e2e_ms.p99),
            "-" if lv.goodput is None else f"{lv.goodput:.0%}",
            f(lv.peak_memory_mb),
            f(s.limit_mb),
            "ok" if s.problem is None else s.problem,
        )
    return t


async def _one_step(args: argparse.Namespace, url: str, concurrency: int) -> LevelSummary:
    async with make_client(concurrency, args.timeout_s) as client:
        await check_reachable(client, url)
        model = await resolve_model(client, url, args)
        count = args.requests_per_level or max(8, 4 * concurrency)
        plan = plan_from(args, url, model, count)
        if args.requests_per_level is None and args.duration_s is None:
            plan.requests = count
        return await run_level(client, plan, concurrency, PromptCycle(plan.prompts))


def run_steps(
    args: argparse.Namespace,
    config: DeploymentConfig | None,
    choice: tuple[str, dict[str, str]],
    console: Console,
) -> tuple[list[Step], str | None]:
    """The steps run, and why the search ended early if a replica would not start.

    A replica that will not start at the FIRST step is an error (ReplicaStartError); at a later
    step it ends the search, since an engine may reserve memory per slot at start-up.
    """
    headroom = args.headroom_mb
    if headroom is None:
        headroom = config.replicas.headroom_mb if config is not None else 1024
    name, env = choice  # from _replica_choice
    steps: list[Step] = []
    what = "client concurrency" if args.url else "max_concurrency"
    for c in steps_up_to(args.up_to):
        console.print(f"step {what}={c} ...")
        if args.url:
            summary = asyncio.run(_one_step(args, args.url, c))
        else:
            replica_args = [
                "--config",
                str(args.config),
                "--replica",
                name,
                "--max-concurrency",
                str(c),
            ]
            try:
                with replica(replica_args, env=env, ready_timeout_s=args.ready_timeout_s) as p:
                    summary = asyncio.run(_one_step(args, p.url, c))
            except ReplicaStartError as exc:
                if not steps:
                    raise
                console.print(f"[yellow]max_concurrency={c}:[/yellow] {exc}")
                return steps, f"{c} failed: the replica did not start with max_concurrency={c}"
        problem, limit = judge(summary, headroom, args.min_goodput)
        steps.append(Step(c, summary, limit, problem))
        if problem is not None:
            break
    return steps, None


def _replica_choice(
    args: argparse.Namespace, config: DeploymentConfig | None
) -> tuple[str, dict[str, str]]:
    if config is None:
        return "", {}
    gpus = [g.index for g in list_gpus()] if config.replicas.devices == "all" else None
    settings = config.replica_settings(gpus)
    chosen = next((s for s in settings if s.name == (args.replica or settings[0].name)), None)
    if chosen is None:
        names = ", ".join(s.name for s in settings)
        raise UsageError(f"--replica {args.replica!r}: the config has {names}")
    env = pin_to_gpu(chosen.cuda_visible_devices) if chosen.cuda_visible_devices else {}
    return chosen.name, env


def recommend(steps: Sequence[Step]) -> int | None:
    passed = [s.concurrency for s in steps if s.problem is None]
    return max(passed) if passed else None


def write_outputs(out: Path, steps: Sequence[Step], best: int | None, what: str) -> None:
    """tune.json (the verdict and every step's summary), results.csv and ladder.png."""
    out.mkdir(parents=True, exist_ok=True)
    record = {
        "recommended": best,
        "steps": [
            {
                "concurrency": s.concurrency,
                "problem": s.problem,
                "limit_mb": s.limit_mb,
                "summary": s.summary.model_dump(mode="json"),
            }
            for s in steps
        ],
    }
    (out / "tune.json").write_text(json.dumps(record, indent=2) + "\n")
    summaries = [s.summary for s in steps]
    report.write_csv(out / "results.csv", summaries)
    report.write_png(out / "ladder.png", summaries, title=f"tune: {what}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    console = Console(stderr=True)
    config: DeploymentConfig | None = None
    try:
        if args.config is None and args.url is None:
            raise UsageError("give a CONFIG to start replicas from, or --url of a running server")
        if args.url:
            args.url = base_url(args.url)
        if args.url and args.write:
            raise UsageError(
                "--write needs replicas started from CONFIG (not --url): "
                "tune cannot change a running server's max_concurrency"
            )
        if args.up_to < 1:
            raise UsageError(f"--up-to: must be >= 1, got {args.up_to}")
        if not 0 <= args.min_goodput <= 1:
            raise UsageError(f"--min-goodput: must be within 0..1, got {args.min_goodput}")
        if args.headroom_mb is not None and not args.headroom_mb >= 0:
            raise UsageError(f"--headroom-mb: must be >= 0, got {args.headroom_mb}")
        check_load_args(args)
        plan_from(args, args.url or "http://127.0.0.1", "x", 1)  # validates SLO and prompts
        if args.out is not None:
            prepare_out(args.out)
        if args.config is not None:
            config = load_config(args.config)
        choice = _replica_choice(args, config)
    except (UsageError, WorkloadError, ConfigError) as exc:
        parser.error(str(exc))
    try:
        steps, start_failure = run_steps(args, config, choice, console)
    except (ReplicaStartError, ConnectionError) as exc:
        console.print(f"[red]error:[/red] {exc}")
        return 1
    except KeyboardInterrupt:  # the step's replica was stopped on the way out
        console.print("[yellow]interrupted:[/yellow] no recommendation, nothing written")
        return 130
    best = recommend(steps)
    what = "client concurrency" if args.url else "max_concurrency"
    if not slo_from(args).any:
        console.print(
            "[yellow]note:[/yellow] no SLO given (--slo-ttft-ms, --slo-tpot-ms, --slo-e2e-ms): "
            "latency did not limit the value, only failures, 429s and memory"
        )
    Console(width=None if sys.stdout.isatty() else 160).print(
        evidence_table(steps, title=f"tune: {what} by step")
    )
    if args.out is not None:
        write_outputs(args.out, steps, best, what)
    if best is None:
        console.print(f"[red]no safe {what}:[/red] even 1 failed ({steps[0].problem})")
        return 1
    last = steps[-1]
    why = start_failure or (
        f"{last.concurrency} failed: {last.problem}"
        if last.problem
        else f"--up-to {args.up_to} reached"
    )
    print(f"recommended {what}: {best} ({why})")
    if args.write:
        try:
            old = set_max_concurrency(args.config, best)
        except (YamlEditError, OSError) as exc:
            console.print(f"[red]error:[/red] cannot write {args.config}: {exc}")
            return 1
        print(f"wrote replicas.max_concurrency: {best} to {args.config} (was {old or 'unset'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
