"""The small JSON file through which a running `gpupool up` tells `gpupool status` its restarts.

One file per router port: ``<state dir>/up-<port>.json``. The state dir is ``GPUPOOL_STATE_DIR``,
else ``$GPUPOOL_CACHE/run``, else ``~/.cache/gpupool/run``. The launcher rewrites the file
atomically whenever a child starts, exits or is given up on, and removes it on exit. A file whose
launcher pid is no longer alive is stale and ignored (e.g. after ``kill -9``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any


def state_dir(env: Mapping[str, str]) -> Path:
    if env.get("GPUPOOL_STATE_DIR"):
        return Path(env["GPUPOOL_STATE_DIR"])
    if env.get("GPUPOOL_CACHE"):
        return Path(env["GPUPOOL_CACHE"]) / "run"
    return Path(env.get("HOME", "~")).expanduser() / ".cache" / "gpupool" / "run"


def state_path(env: Mapping[str, str], router_port: int) -> Path:
    return state_dir(env) / f"up-{router_port}.json"


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie is not alive: it only waits for its parent to reap it.
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[-1].split()[0] != "Z"


def write_state(path: Path, data: Mapping[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=2))
    os.replace(tmp, path)


def read_state(path: Path) -> dict[str, Any] | None:
    """The state of a live launcher, or None (no file, unreadable, or its launcher is gone)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict):
        return None
    pid = data.get("launcher_pid")
    if not isinstance(pid, int) or not pid_alive(pid):
        return None
    return data
