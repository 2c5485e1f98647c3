"""`gpupool status`: the router's view of each replica, plus the launcher's restart counts.

State, load, queue and memory come from the router's ``GET /replicas``; restarts come from the
state file a running `gpupool up` keeps for that router port (see deploy/state.py). Replicas the
router does not list but the launcher runs (or gave up on) are shown too.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any
from urllib.parse import urlsplit

import httpx
from rich.table import Table

GIB = 1024**3


class StatusError(RuntimeError):
    """The router could not be asked; the message is for a person."""


def fetch_replicas(
    url: str, client: httpx.Client, headers: Mapping[str, str]
) -> list[dict[str, Any]]:
    try:
        r = client.get(url.rstrip("/") + "/replicas", headers=dict(headers))
    except httpx.HTTPError as exc:
        raise StatusError(f"cannot reach the router at {url}: {exc}") from exc
    if r.status_code != 200:
        raise StatusError(f"{url}/replicas answered {r.status_code}: {r.text[:300]}")
    try:
        body = r.json()
    except ValueError as exc:
        raise StatusError(f"{url}/replicas did not answer JSON") from exc
    items = body.get("replicas", []) if isinstance(body, dict) else body
    if not isinstance(items, list):
        raise StatusError(f"{url}/replicas: unexpected answer {str(body)[:300]}")
    return [i for i in items if isinstance(i, dict)]


def local_router_port(url: str) -> int | None:
    """The port of a router on this machine (its `gpupool up` keeps a state file), else None."""
    parts = urlsplit(url)
    if parts.hostname not in ("127.0.0.1", "localhost", "0.0.0.0", "::1"):
        return None
    if parts.port is not None:
        return parts.port
    return 443 if parts.scheme == "https" else 80


def _memory(mem: Any) -> str:
    if not isinstance(mem, dict) or not mem.get("total_bytes"):
        return "-"
    return f"{mem.get('used_bytes', 0) / GIB:.1f}/{mem['total_bytes'] / GIB:.1f} GiB"


def _num(value: Any, fmt: str = "{}") -> str:
    return "-" if value is None else fmt.format(value)


def build_table(
    replicas: Sequence[Mapping[str, Any]], launcher: Mapping[str, Any] | None, url: str
) -> Table:
    children = {
        c.get("url"): c
        for c in (launcher or {}).get("children", [])
        if isinstance(c, dict) and c.get("kind") == "replica"
    }
    table = Table(title=f"gpupool replicas behind {url}", title_justify="left")
    for column in ("replica", "state", "load", "running", "queued", "memory", "restarts", "url"):
        justify = "right" if column in ("load", "running", "queued", "restarts") else "left"
        table.add_column(column, justify=justify)  # type: ignore[arg-type]
    seen = set()
    for r in replicas:
        child = children.get(str(r.get("url", "")).rstrip("/"))
        seen.add(str(r.get("url", "")).rstrip("/"))
        state = str(r.get("state", "?"))
        if child is not None and child.get("state") in ("backoff", "down"):
            state = f"{state} ({'restarting' if child['state'] == 'backoff' else 'gave up'})"
        table.add_row(
            str(r.get("name", "?")),
            state,
            _num(r.get("load"), "{:.2f}"),
            _num(r.get("reported_in_flight", r.get("in_flight"))),
            _num(r.get("reported_queued", r.get("queued"))),
            _memory(r.get("memory")),
            _num(child.get("restarts")) if child else "-",
            str(r.get("url", "")),
        )
    for child_url, child in children.items():
        if child_url not in seen:
            table.add_row(
                str(child.get("name")),
                f"not routed ({child.get('state')})",
                "-",
                "-",
                "-",
                "-",
                _num(child.get("restarts")),
                str(child_url),
            )
    return table
