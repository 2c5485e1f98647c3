"""What `gpupool up` shows a person: the loading table and the summary once everything is up."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from rich.console import Console
from rich.table import Table

from common.config import DeploymentConfig
from deploy.plan import ChildSpec


def loading_table(rows: Sequence[tuple[str, ChildSpec, bool]], waited_s: float) -> Table:
    """One row per child being started: name, device, URL, and ready or how long it has loaded."""
    table = Table(title="starting gpupool", title_justify="left")
    for column in ("name", "device", "url", "state"):
        table.add_column(column)
    for name, spec, ready in rows:
        state = "ready" if ready else f"loading ({waited_s:.0f}s)"
        table.add_row(name, spec.device, spec.url, state)
    return table


def print_summary(
    console: Console, cfg: DeploymentConfig, specs: Sequence[ChildSpec], log_dir: Path
) -> None:
    """URL, replicas and their devices, model and limits, and where to look next."""
    r, m = cfg.replicas, cfg.model
    router = next(s for s in specs if s.kind == "router")
    table = Table(title=f"gpupool is up: {router.url}", title_justify="left")
    for column in ("replica", "device", "url"):
        table.add_column(column)
    for spec in specs:
        if spec.kind == "replica":
            table.add_row(spec.name, spec.device, spec.url)
    for name, url in cfg.remote_endpoints():
        table.add_row(name, "remote", url)
    console.print(table)
    console.print(
        f"model {m.source} (dtype {m.dtype}); per replica: max_concurrency {r.max_concurrency}, "
        f"max_queue {r.max_queue}, queue_timeout_s {r.queue_timeout_s:g}, request_timeout_s "
        f"{r.request_timeout_s:g}; max_input_tokens {m.max_input_tokens}, max_new_tokens "
        f"{m.max_new_tokens}",
        soft_wrap=True,
        highlight=False,
    )
    console.print(
        f"try: curl {router.url}/v1/completions -H 'content-type: application/json' "
        """-d '{"prompt": "Hello", "max_tokens": 16}'""",
        soft_wrap=True,
        highlight=False,
        markup=False,
    )
    console.print(
        f"logs in {log_dir}; `gpupool status --url {router.url}`; Ctrl-C to stop",
        soft_wrap=True,
        highlight=False,
        markup=False,
    )
