"""``python -m replica``: one replica process (one device, one uvicorn worker).

    python -m replica --model SOURCE [--device cpu|cuda|cuda:N] [--port P] [--host H] ...
    python -m replica --config deploy.yaml --replica gpu0 [--port P ...]

Flags given explicitly override the values from ``--config``. Bad flags, a bad config or a bad
model source: one line on stderr and exit status 2. A model that fails while loading: exit 2
(ModelLoadError) or 1 (anything else).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any

import uvicorn
from pydantic import ValidationError

from common.config import (
    ConfigError,
    ReplicaSettings,
    format_validation_error,
    load_config,
)
from common.gpu import list_gpus, pin_to_gpu
from replica.errors import ModelLoadError

log = logging.getLogger("replica")

# flag dest -> (section, key) in ReplicaSettings ("" = top level, "model" = ModelConfig)
_OVERRIDES = {
    "model": ("model", "source"),
    "dtype": ("model", "dtype"),
    "max_input_tokens": ("model", "max_input_tokens"),
    "max_new_tokens": ("model", "max_new_tokens"),
    "device": ("", "device"),
    "host": ("", "host"),
    "port": ("", "port"),
    "max_concurrency": ("", "max_concurrency"),
    "max_queue": ("", "max_queue"),
    "queue_timeout_s": ("", "queue_timeout_s"),
    "request_timeout_s": ("", "request_timeout_s"),
    "name": ("", "name"),
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m replica",
        description="Serve one model on one device behind an admission gate (OpenAI API).",
    )
    p.add_argument(
        "--model",
        help="builtin:smollm2-135m | builtin:tiny-random | HF folder | "
        "file.gguf | simulated[:k=v,...]",
    )
    p.add_argument("--device", help="cpu | cuda | cuda:N (default cpu)")
    p.add_argument("--host", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="port to bind (default 9100)")
    p.add_argument("--max-concurrency", type=int, help="requests inside the engine at once")
    p.add_argument("--max-queue", type=int, help="requests waiting for a slot; beyond: 429")
    p.add_argument("--queue-timeout-s", type=float, help="longest wait in the queue; then 503")
    p.add_argument("--request-timeout-s", type=float, help="longest generation; then 504")
    p.add_argument("--max-input-tokens", type=int, help="longest prompt in tokens; beyond: 400")
    p.add_argument("--max-new-tokens", type=int, help="largest max_tokens a request may ask")
    p.add_argument("--dtype", choices=["auto", "bfloat16", "float16", "float32"])
    p.add_argument("--name", help="replica name (shown in its logs)")
    p.add_argument("--config", help="deployment YAML to take the settings from")
    p.add_argument("--replica", help="which replica of --config (cpu0, gpu3, ...)")
    return p


def _from_config(path: str, name: str | None) -> ReplicaSettings:
    config = load_config(path)
    gpus = [g.index for g in list_gpus()] if config.replicas.devices == "all" else None
    entries = config.replica_settings(gpus)
    names = [s.name for s in entries]
    if not entries:
        raise ConfigError(
            f"--config {path} has no local replica to run (replicas.devices is empty: "
            "a router-only host)"
        )
    if name is None:
        if len(entries) == 1:
            return entries[0]
        raise ConfigError(
            f"--config {path} has several replicas ({', '.join(names)}): pick one "
            "with --replica NAME"
        )
    for entry in entries:
        if entry.name == name:
            return entry
    raise ConfigError(f"--replica {name}: no such replica in {path} (it has {', '.join(names)})")


def settings_from_args(args: argparse.Namespace) -> ReplicaSettings:
    """Flags (and --config) -> ReplicaSettings; ConfigError with a one-line reason."""
    if args.config is None:
        if args.replica is not None:
            raise ConfigError("--replica needs --config FILE")
        if args.model is None:
            raise ConfigError("give --model SOURCE (or --config FILE --replica NAME)")
        base: dict[str, Any] = {}
    else:
        base = _from_config(args.config, args.replica).model_dump()
    base.setdefault("model", {})
    for dest, (section, key) in _OVERRIDES.items():
        value = getattr(args, dest)
        if value is None:
            continue
        if section:
            base[section][key] = value
        else:
            base[key] = value
    try:
        settings = ReplicaSettings.model_validate(base)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc).replace("\n", "; ")) from exc
    return settings


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        settings = settings_from_args(args)
    except ConfigError as exc:
        print(f"replica: error: {exc}", file=sys.stderr)
        return 2
    if settings.cuda_visible_devices is not None and "CUDA_VISIBLE_DEVICES" not in os.environ:
        os.environ.update(pin_to_gpu(settings.cuda_visible_devices))
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    from replica.app import create_app  # after the environment is settled

    server: uvicorn.Server | None = None

    def stop_on_failure(exc: BaseException) -> None:
        if server is not None:
            server.should_exit = True

    try:
        app = create_app(settings, on_load_failed=stop_on_failure)
    except (ModelLoadError, ConfigError) as exc:
        print(f"replica: error: {exc}", file=sys.stderr)
        return 2
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        workers=1,
        log_level="info",
        access_log=False,
        # Longer than the router's pooled-connection expiry (httpx: 5 s), so the router never
        # sends on a connection this server is closing.
        timeout_keep_alive=30,
        timeout_graceful_shutdown=int(settings.request_timeout_s + settings.queue_timeout_s),
    )
    server = uvicorn.Server(config)
    server.run()
    state = app.state.replica
    if state.status == "failed":
        print(f"replica: error: model failed to load: {state.error}", file=sys.stderr)
        return 2 if isinstance(state.load_exception, ModelLoadError) else 1
    if not server.started:
        return 1  # could not bind, for example; uvicorn said why
    return 0


if __name__ == "__main__":
    sys.exit(main())
