"""``python -m router --config FILE`` or ``python -m router --replica URL [--replica URL ...]``.

Flags override the YAML's ``router:`` section. ``--replica`` takes ``URL`` or ``NAME=URL``;
``--discover NAME[:PORT]`` resolves a DNS name periodically (Kubernetes headless Service).
Always one uvicorn worker: the pool state lives in this one process.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

import uvicorn
from pydantic import ValidationError

from common.config import (
    ConfigError,
    DnsDiscovery,
    RouterConfig,
    check_url,
    format_validation_error,
    load_config,
)
from common.gpu import list_gpus
from router.app import create_app
from router.settings import ReplicaSpec, RouterSettings, from_deployment

# RouterConfig fields that may be set on the command line: (type, help).
_KNOBS: dict[str, tuple[type, str]] = {
    "health_interval_s": (float, "seconds between /health probes of each replica (1.0)"),
    "health_timeout_s": (float, "deadline of one probe (1.0)"),
    "fail_threshold": (int, "failed probes (or 5xx answers) in a row that eject (2)"),
    "success_threshold": (int, "good probes in a row that bring a replica back (1)"),
    "min_free_memory_mb": (int, "a GPU replica with less free memory takes no new work (1024)"),
    "max_attempts": (int, "attempts per request across replicas; 1 = never retry (3)"),
    "retry_budget_ratio": (float, "retries allowed as a share of recent requests (0.2)"),
    "request_timeout_s": (float, "longest silence from a replica within a request (300)"),
    "connect_timeout_s": (float, "deadline to connect to a replica (2.0)"),
    "drain_timeout_s": (float, "on SIGTERM, how long in-flight requests may run (30)"),
    "api_keys_env": (str, "env var with comma-separated API keys (GPUPOOL_API_KEYS)"),
    "admin_keys_env": (str, "env var with comma-separated admin keys (GPUPOOL_ADMIN_KEYS)"),
}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="gpupool router", description="Least-loaded router in front of gpupool replicas."
    )
    p.add_argument("--config", help="deployment YAML (replicas and the router: section)")
    p.add_argument(
        "--replica",
        action="append",
        default=[],
        metavar="[NAME=]URL",
        help="a replica's base URL (repeatable), e.g. http://127.0.0.1:9100 or gpu0=http://...",
    )
    p.add_argument("--discover", metavar="NAME[:PORT]", help="DNS name to resolve for replicas")
    p.add_argument("--discover-interval-s", type=float, default=None)
    p.add_argument("--host", default=None, help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=None, help="port (default 8000)")
    p.add_argument(
        "--max-concurrency", type=int, default=None, help="a replica's, until it reports (1)"
    )
    p.add_argument("--max-queue", type=int, default=None, help="a replica's, until it reports (32)")
    p.add_argument("--foreign-max-concurrency", type=int, default=8)
    p.add_argument("--foreign-max-queue", type=int, default=64)
    p.add_argument(
        "--http-client",
        choices=["lean", "httpx"],
        default="lean",
        help="upstream HTTP client (lean: the router's own transport; httpx: httpx's pool)",
    )
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    for knob, (kind, text) in _KNOBS.items():
        p.add_argument("--" + knob.replace("_", "-"), type=kind, default=None, help=text)
    return p.parse_args(argv)


def build_settings(args: argparse.Namespace) -> RouterSettings:
    if args.config:
        config = load_config(args.config)
        local = config.replicas.devices == "all" and config.router.discovery is None
        gpus = [g.index for g in list_gpus()] if local else None
        settings = from_deployment(config, gpus)
        router = settings.router
    else:
        settings = RouterSettings()
        router = RouterConfig()
    updates = {k: getattr(args, k) for k in _KNOBS if getattr(args, k) is not None}
    if args.host is not None:
        updates["host"] = args.host
    if args.port is not None:
        updates["port"] = args.port
    if args.discover:
        name, _, port = args.discover.partition(":")
        discovery = {"name": name}
        if port:
            discovery["port"] = port
        if args.discover_interval_s is not None:
            discovery["interval_s"] = args.discover_interval_s
        try:
            updates["discovery"] = DnsDiscovery.model_validate(discovery)
        except ValidationError as exc:
            raise ConfigError(format_validation_error(exc, prefix="--discover: ")) from None
    overrides: dict[str, object] = {
        "foreign_max_concurrency": args.foreign_max_concurrency,
        "foreign_max_queue": args.foreign_max_queue,
        "http_client": args.http_client,
    }
    if args.max_concurrency is not None:
        overrides["default_max_concurrency"] = args.max_concurrency
    if args.max_queue is not None:
        overrides["default_max_queue"] = args.max_queue
    try:
        router = RouterConfig.model_validate({**router.model_dump(), **updates})
        settings = RouterSettings.model_validate(
            {**settings.model_dump(), **overrides, "router": router.model_dump()}
        )
    except ValidationError as exc:
        raise ConfigError(_flag_errors(exc)) from None
    specs = list(settings.replicas)
    for entry in args.replica:
        name, sep, url = entry.partition("=")
        if not sep or "://" in name:
            name, url = "", entry
        try:
            url = check_url(url)
        except ValueError as exc:
            raise ConfigError(f"--replica {entry!r}: {exc}") from None
        name = name or url.split("://", 1)[1]
        specs.append(
            ReplicaSpec(
                name=name,
                url=url,
                max_concurrency=settings.default_max_concurrency,
                max_queue=settings.default_max_queue,
            )
        )
    names = [s.name for s in specs]
    if len(names) != len(set(names)):
        raise ConfigError(f"replica names repeat: {names}")
    urls = [s.url for s in specs]
    if len(urls) != len(set(urls)):
        # Two names for one replica would split its load in two and overfill it.
        raise ConfigError(f"replica URLs repeat: {urls}")
    if not specs and settings.router.discovery is None:
        raise ConfigError("no replicas: give --config FILE, --replica URL or --discover NAME")
    return settings.model_copy(update={"replicas": specs})


# RouterSettings fields whose flag is not simply --field-name.
_FLAGS = {"default_max_concurrency": "--max-concurrency", "default_max_queue": "--max-queue"}


def _flag_errors(exc: ValidationError) -> str:
    """``--flag: problem`` per line (flags override validated YAML, so a flag is to blame)."""
    lines = []
    for line in format_validation_error(exc).splitlines():
        path, sep, problem = line.partition(": ")
        field = path.removeprefix("router.")
        if sep and "." not in field:
            line = f"{_FLAGS.get(field, '--' + field.replace('_', '-'))}: {problem}"
        lines.append(line)
    return "invalid flags: " + "; ".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        settings = build_settings(args)
    except ConfigError as exc:
        print(f"gpupool router: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    # httpx logs every request at INFO: one line per probe and per proxied request is noise.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    cfg = settings.router
    app = create_app(settings)
    uvicorn.run(
        app,
        host=cfg.host,
        port=cfg.port,
        workers=1,
        access_log=False,
        log_level=args.log_level,
        timeout_graceful_shutdown=max(int(cfg.drain_timeout_s), 1),
        lifespan="on",
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
