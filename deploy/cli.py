"""`gpupool`: one command for the whole project.

``up`` and ``status`` are implemented here (deploy/launcher.py, deploy/status.py). ``replica``,
``router``, ``ladder``, ``tune`` and ``model`` replace this process with ``python -m <module>``
and the remaining arguments unchanged, so each tool's own ``--help`` is the reference for its
flags and nothing here imports torch or the servers.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path

import httpx
import typer
from rich.console import Console

from deploy.drain import admin_key, bearer
from deploy.launcher import run_up
from deploy.state import read_state, state_path
from deploy.status import StatusError, build_table, fetch_replicas, local_router_port

PASSTHROUGH = {
    "replica": ("replica", "Run one replica server (python -m replica)"),
    "router": ("router", "Run the router alone (python -m router)"),
    "ladder": ("bench.ladder", "Stepped load test (python -m bench.ladder)"),
    "tune": ("bench.tune", "Find the largest safe max_concurrency (python -m bench.tune)"),
    "model": ("replica.models", "Check, prepare or size a model source (python -m replica.models)"),
}

app = typer.Typer(
    name="gpupool",
    help="One replica per GPU behind a least-loaded router. Start with: gpupool up",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def exec_module(module: str, args: Sequence[str]) -> None:
    """Become ``python -m module *args`` (never returns), able to import gpupool from anywhere."""
    root = str(Path(__file__).resolve().parent.parent)
    path = [p for p in os.environ.get("PYTHONPATH", "").split(":") if p]
    if root not in path:
        os.environ["PYTHONPATH"] = ":".join([root, *path])
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, [sys.executable, "-m", module, *args])


@app.command()
def up(
    config: str | None = typer.Argument(
        None,
        help="Deployment YAML. Default: configs/local.yaml in the current directory, "
        "else the one shipped with gpupool (two CPU replicas of SmolLM2, router on :8000).",
        show_default=False,
    ),
) -> None:
    """Start the replicas and the router from a YAML file; supervise them until Ctrl-C."""
    raise typer.Exit(run_up(config, Console(highlight=False)))


@app.command()
def status(
    url: str = typer.Option("http://127.0.0.1:8000", help="The router's base URL."),
    key: str | None = typer.Option(
        None,
        help="Admin or API key for the router, if it needs one "
        "(default: first key in GPUPOOL_ADMIN_KEYS, else GPUPOOL_API_KEYS).",
        show_default=False,
    ),
) -> None:
    """Show each replica behind a router: state, load, queue, memory, restarts."""
    # Piped or captured: do not squeeze the table into 80 columns.
    console = Console(highlight=False, width=None if sys.stdout.isatty() else 160)
    headers = bearer(key or admin_key(os.environ))
    try:
        with httpx.Client(timeout=5.0) as client:
            replicas = fetch_replicas(url, client, headers)
    except StatusError as exc:
        console.print(f"[bold red]error:[/] {exc}", soft_wrap=True)
        raise typer.Exit(1) from exc
    port = local_router_port(url)
    launcher = read_state(state_path(os.environ, port)) if port is not None else None
    console.print(build_table(replicas, launcher, url))
    if launcher is None:
        console.print("restarts: no `gpupool up` on this machine runs this router", style="dim")


def _passthrough(name: str, module: str, help_text: str) -> None:
    @app.command(
        name,
        help=help_text + ". All arguments go to it unchanged; see `gpupool " + name + " --help`.",
        context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
        add_help_option=False,
    )
    def command(ctx: typer.Context) -> None:
        exec_module(module, ctx.args)


for _name, (_module, _help) in PASSTHROUGH.items():
    _passthrough(_name, _module, _help)


def main(argv: Sequence[str] | None = None) -> None:
    """Console-script entry point."""
    args = list(sys.argv[1:] if argv is None else argv)
    # Pass-through commands skip typer entirely, so even `--help` reaches the tool itself.
    if args and args[0] in PASSTHROUGH:
        exec_module(PASSTHROUGH[args[0]][0], args[1:])
    app(args=args, prog_name="gpupool")
