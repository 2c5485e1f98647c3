"""Helpers of the router's integration tests: its /replicas as a dict, a bounded wait."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import httpx


def replicas(router_url: str, **headers: str) -> dict[str, dict[str, Any]]:
    """``GET /replicas``, by replica name."""
    body = httpx.get(router_url + "/replicas", headers=headers, timeout=5).json()
    return {r["name"]: r for r in body["replicas"]}


def wait_for(predicate: Callable[[], Any], timeout_s: float = 10.0) -> None:
    """Until ``predicate()`` is true; AssertionError after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"condition not met within {timeout_s}s")
