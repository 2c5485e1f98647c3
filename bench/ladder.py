"""Stepped load test: ``python -m bench.ladder --url URL [...]`` (also ``gpupool ladder``).

Runs each concurrency level in turn (closed loop, see ``bench/runner.py``), shows live progress,
prints a table, and writes ``results.json``, ``results.csv`` and ``ladder.png`` into ``--out``.
Works against a replica or a router (memory then comes from the router's ``/replicas``).
Exit status: 0 when every level ran, 2 for bad arguments, 1 when the server cannot be reached,
130 when interrupted (Ctrl-C), after writing the levels that finished.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from bench import report
from bench.client import RequestSpec
from bench.runner import LevelPlan, PromptCycle, discover_model, make_client, run_level
from bench.stats import LevelSummary, RequestResult, Slo
from bench.workload import Prompt, WorkloadError, generate, load_dataset, parse_token_range

DEFAULT_LEVELS = "1,2,4,8,16"
MAX_LEVEL = 10_000  # clients in one level: each is a task and an open connection


class UsageError(ValueError):
    """Arguments that cannot run; the message is for a person."""


def base_url(url: str) -> str:
    """The server's root: ``http://h:p``, also from ``http://h:p/`` or ``http://h:p/v1``."""
    if not url.startswith(("http://", "https://")):
        raise UsageError(f"--url must start with http:// or https://, got {url!r}")
    url = url.rstrip("/")
    return url.removesuffix("/v1")


def parse_levels(spec: str) -> list[int]:
    try:
        levels = [int(p) for p in spec.split(",") if p.strip()]
    except ValueError as exc:
        raise UsageError(f"--levels: expected integers like 1,2,4,8, got {spec!r}") from exc
    if not levels or any(n < 1 for n in levels):
        raise UsageError(f"--levels: expected integers >= 1, got {spec!r}")
    if max(levels) > MAX_LEVEL:
        raise UsageError(f"--levels: at most {MAX_LEVEL} clients per level, got {max(levels)}")
    return levels


def add_load_options(p: argparse.ArgumentParser) -> None:
    """The options ``ladder`` and ``tune`` share: the workload, the SLO and the client."""
    p.add_argument(
        "--requests-per-level",
        type=int,
        default=None,
        metavar="N",
        help="requests per level (ladder: 32; tune: 4 per client, at least 8)",
    )
    p.add_argument(
        "--duration-s",
        type=float,
        default=None,
        metavar="S",
        help="run each level for S seconds instead of a request count",
    )
    p.add_argument(
        "--max-level-s",
        type=float,
        default=300.0,
        metavar="S",
        help="hard cap on one level's time, whatever else is set (default 300)",
    )
    p.add_argument(
        "--dataset",
        type=Path,
        default=None,
        metavar="FILE.jsonl",
        help='prompts, one JSON object per line: {"prompt": str} or '
        '{"messages": [{"role", "content"}, ...]}, optional "max_tokens"',
    )
    p.add_argument(
        "--prompt-tokens",
        default="128",
        metavar="N|LOW:HIGH",
        help="generated prompt tokens: N (each about N) or LOW:HIGH (uniform); default 128",
    )
    p.add_argument(
        "--max-tokens", type=int, default=64, help="output tokens per request (default 64)"
    )
    p.add_argument(
        "--stream", action="store_true", help="stream answers (needed for TTFT, TPOT, ITL)"
    )
    p.add_argument("--slo-ttft-ms", type=float, default=None)
    p.add_argument("--slo-e2e-ms", type=float, default=None)
    p.add_argument("--slo-tpot-ms", type=float, default=None)
    p.add_argument("--api-key", default=None, help="sent as Authorization: Bearer KEY")
    p.add_argument(
        "--model", default=None, help="model name to send (default: first of /v1/models)"
    )
    p.add_argument("--endpoint", choices=("chat", "completions"), default="completions")
    p.add_argument("--timeout-s", type=float, default=120.0, help="per request (default 120)")
    p.add_argument("--seed", type=int, default=0, help="seed of the generated prompts")
    p.add_argument(
        "--sample-interval-s",
        type=float,
        default=0.1,
        help="how often memory is sampled during a level (default 0.1, at least 0.01)",
    )
    p.add_argument(
        "--reject-pause-ms",
        type=float,
        default=100.0,
        help="a client pauses this long after a 429 before its next request",
    )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="gpupool ladder",
        description="Stepped load test of a replica or a router: one closed-loop level per "
        "concurrency; results.json, results.csv and ladder.png in --out.",
    )
    p.add_argument("--url", required=True, help="a replica or router, e.g. http://127.0.0.1:8000")
    p.add_argument(
        "--levels", default=DEFAULT_LEVELS, help=f"concurrency levels (default {DEFAULT_LEVELS})"
    )
    p.add_argument("--out", type=Path, default=Path("ladder-results"), help="output folder")
    p.add_argument("--title", default=None, help="title of the plot and table")
    add_load_options(p)
    return p


def slo_from(args: argparse.Namespace) -> Slo:
    slo = Slo(ttft_ms=args.slo_ttft_ms, e2e_ms=args.slo_e2e_ms, tpot_ms=args.slo_tpot_ms)
    if slo.tpot_ms is not None and not args.stream:
        raise UsageError("--slo-tpot-ms needs --stream (without it no token timing is seen)")
    for name in ("slo_ttft_ms", "slo_e2e_ms", "slo_tpot_ms"):
        value = getattr(args, name)
        if value is not None and not value > 0:  # also refuses nan
            raise UsageError(f"--{name.replace('_', '-')}: must be > 0, got {value}")
    return slo


def check_load_args(args: argparse.Namespace) -> None:
    if args.requests_per_level is not None and args.duration_s is not None:
        raise UsageError("give --requests-per-level or --duration-s, not both")
    checks: list[tuple[str, Any, Callable[[Any], bool]]] = [
        ("requests-per-level", args.requests_per_level, lambda v: v is None or v >= 1),
        ("duration-s", args.duration_s, lambda v: v is None or v > 0),
        ("max-level-s", args.max_level_s, lambda v: v > 0),
        ("max-tokens", args.max_tokens, lambda v: v >= 1),
        ("timeout-s", args.timeout_s, lambda v: v > 0),
        ("sample-interval-s", args.sample_interval_s, lambda v: v >= 0.01),  # no busy polling
        ("reject-pause-ms", args.reject_pause_ms, lambda v: v >= 0),
    ]
    for name, value, ok in checks:
        if not ok(value):
            raise UsageError(f"--{name}: out of range ({value})")


def prepare_out(out: Path) -> None:
    """Create the output folder before any load is sent, so a bad --out costs no run."""
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"--out {out}: cannot create the folder: {exc.strerror or exc}") from exc
    if not os.access(out, os.W_OK):
        raise UsageError(f"--out {out}: the folder is not writable")


def prompts_from(args: argparse.Namespace, count: int) -> list[Prompt]:
    if args.dataset is not None:
        return load_dataset(args.dataset)
    return generate(count, parse_token_range(args.prompt_tokens), args.seed)


def plan_from(args: argparse.Namespace, url: str, model: str, prompt_count: int) -> LevelPlan:
    requests = args.requests_per_level
    if requests is None and args.duration_s is None:
        requests = 32
    spec = RequestSpec(
        base_url=url,
        endpoint=args.endpoint,
        model=model,
        max_tokens=args.max_tokens,
        stream=args.stream,
        api_key=args.api_key,
        timeout_s=args.timeout_s,
    )
    return LevelPlan(
        spec=spec,
        prompts=prompts_from(args, prompt_count),
        requests=requests,
        duration_s=args.duration_s,
        max_level_s=args.max_level_s,
        slo=slo_from(args),
        sample_interval_s=args.sample_interval_s,
        reject_pause_s=args.reject_pause_ms / 1000.0,
    )


async def resolve_model(client: httpx.AsyncClient, url: str, args: argparse.Namespace) -> str:
    if args.model:
        return str(args.model)
    probe = RequestSpec(
        base_url=url,
        endpoint="completions",
        model="",
        max_tokens=1,
        stream=False,
        api_key=args.api_key,
    )
    return await discover_model(client, probe) or "default"


async def check_reachable(client: httpx.AsyncClient, url: str) -> None:
    try:
        await client.get(url.rstrip("/") + "/health", timeout=10.0)
    except httpx.HTTPError as exc:
        raise ConnectionError(f"{url}: cannot connect ({type(exc).__name__}: {exc})") from exc


async def run_ladder(
    args: argparse.Namespace,
    levels: Sequence[int],
    console: Console,
    summaries: list[LevelSummary],
    settings: dict[str, Any],
) -> None:
    """Run every level; ``settings`` gets the run's settings, ``summaries`` each finished level."""
    async with make_client(max(levels), args.timeout_s) as client:
        await check_reachable(client, args.url)
        model = await resolve_model(client, args.url, args)
        count = args.requests_per_level or 256
        plan = plan_from(args, args.url, model, count)
        prompts = PromptCycle(plan.prompts)
        settings |= {
            **{k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "model": model,
            "levels": list(levels),
            "api_key": bool(args.api_key),
            "started_at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        }
        with Progress(
            TextColumn("[bold]level {task.fields[level]:>4}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("ok {task.fields[ok]}  429 {task.fields[rej]}  err {task.fields[err]}"),
            TimeElapsedColumn(),
            console=console,
            transient=False,
        ) as progress:
            for level in levels:
                task = progress.add_task("", total=plan.requests, level=level, ok=0, rej=0, err=0)
                counts = {"ok": 0, "rej": 0, "err": 0}

                def tick(
                    r: RequestResult, task: Any = task, counts: dict[str, int] = counts
                ) -> None:
                    counts["ok" if r.ok else "rej" if r.rejected else "err"] += 1
                    progress.update(
                        task, advance=1, ok=counts["ok"], rej=counts["rej"], err=counts["err"]
                    )

                summaries.append(await run_level(client, plan, level, prompts, on_result=tick))


def write_all(
    out: Path, settings: dict[str, Any], levels: Sequence[LevelSummary], title: str
) -> None:
    out.mkdir(parents=True, exist_ok=True)
    report.write_json(out / "results.json", settings, levels)
    report.write_csv(out / "results.csv", levels)
    report.write_png(out / "ladder.png", levels, title=title)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    console = Console(stderr=True)
    try:
        args.url = base_url(args.url)
        levels = parse_levels(args.levels)
        check_load_args(args)
        slo_from(args)
        prompts_from(args, 1)  # a bad dataset or length spec fails before any load
        prepare_out(args.out)
    except (UsageError, WorkloadError) as exc:
        parser.error(str(exc))
    summaries: list[LevelSummary] = []
    settings: dict[str, Any] = {}
    status = 0
    try:
        asyncio.run(run_ladder(args, levels, console, summaries, settings))
    except ConnectionError as exc:
        console.print(f"[red]error:[/red] {exc}")
        return 1
    except KeyboardInterrupt:
        # Keep what was measured: the finished levels are written, the one running is dropped.
        console.print(f"[yellow]interrupted:[/yellow] {len(summaries)} level(s) finished")
        settings["interrupted"] = True
        status = 130
        if not summaries:
            return status
    title = args.title or f"{settings['model']} @ {args.url}"
    write_all(args.out, settings, summaries, title)
    wide = Console(width=None if sys.stdout.isatty() else 160)
    wide.print(report.table(summaries, title=title))
    console.print(f"wrote {args.out}/results.json, results.csv, ladder.png")
    return status


if __name__ == "__main__":
    sys.exit(main())
