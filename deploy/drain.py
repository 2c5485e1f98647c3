"""Drain one gpupool server (router or replica) and wait until its requests are done.

``python -m deploy.drain http://127.0.0.1:9100 --timeout-s 90`` posts ``/admin/drain`` (new
requests get 503; the router stops sending it work), then polls ``/health`` until ``in_flight``
and ``queued`` are both 0 or the timeout passes. Used as a Kubernetes preStop hook and a systemd
ExecStop before the process gets SIGTERM. Needs only httpx; exits 0 when idle, 1 on timeout,
2 when the server could not be drained at all (a server that is already gone counts as idle).
The key, if the server needs one, is the first of GPUPOOL_ADMIN_KEYS, else GPUPOOL_API_KEYS.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence

import httpx


def busy(body: object) -> int:
    """Requests a /health body says are still running or waiting."""
    if not isinstance(body, dict):
        return 0
    return int(body.get("in_flight", 0) or 0) + int(body.get("queued", 0) or 0)


def drain(
    url: str,
    client: httpx.Client,
    timeout_s: float,
    headers: Mapping[str, str],
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
    interval_s: float = 0.5,
) -> int:
    """The exit status described in the module docstring."""
    base = url.rstrip("/")
    try:
        r = client.post(base + "/admin/drain", headers=dict(headers))
    except httpx.ConnectError:
        return 0
    except httpx.HTTPError as exc:
        print(f"drain: {base}: {exc}", file=sys.stderr)
        return 2
    if r.status_code >= 400:
        answer = f"{r.status_code}: {r.text[:200]}"
        print(f"drain: {base}/admin/drain answered {answer}", file=sys.stderr)
        return 2
    deadline = clock() + timeout_s
    while True:
        try:
            left = busy(client.get(base + "/health").json())
        except httpx.ConnectError:
            return 0
        except (httpx.HTTPError, ValueError):
            left = -1
        if left == 0:
            return 0
        if clock() >= deadline:
            print(f"drain: {base}: still busy ({left}) after {timeout_s:g}s", file=sys.stderr)
            return 1
        sleep(interval_s)


def first_key(env: Mapping[str, str], name: str) -> str | None:
    """The first of the comma-separated keys in environment variable ``name``, if any."""
    return next((k.strip() for k in env.get(name, "").split(",") if k.strip()), None)


def admin_key(
    env: Mapping[str, str], admin: str = "GPUPOOL_ADMIN_KEYS", api: str = "GPUPOOL_API_KEYS"
) -> str | None:
    """The key for admin routes: the first admin key, else the first API key."""
    return first_key(env, admin) or first_key(env, api)


def bearer(key: str | None) -> dict[str, str]:
    """The Authorization header that sends ``key``; none without a key."""
    return {"Authorization": f"Bearer {key}"} if key else {}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m deploy.drain", description=__doc__)
    parser.add_argument("url", help="base URL of the router or replica")
    parser.add_argument("--timeout-s", type=float, default=60.0)
    parser.add_argument(
        "--admin-keys-env", default="GPUPOOL_ADMIN_KEYS", help="as router.admin_keys_env"
    )
    parser.add_argument("--api-keys-env", default="GPUPOOL_API_KEYS", help="as router.api_keys_env")
    args = parser.parse_args(argv)
    key = admin_key(os.environ, args.admin_keys_env, args.api_keys_env)
    with httpx.Client(timeout=httpx.Timeout(5.0)) as client:
        return drain(args.url, client, args.timeout_s, bearer(key))


if __name__ == "__main__":
    sys.exit(main())
