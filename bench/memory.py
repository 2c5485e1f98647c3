"""What a ladder targets (one replica, or a router and its replicas) and its memory per level.

A URL is a router when ``GET /replicas`` answers 200 (a replica answers 404). Behind a router the
sampler asks each replica's own ``/health`` (fresh, with ``peak_memory_bytes``) and falls back to
the memory the router last saw (``/replicas``) for a replica it cannot reach. A ``MemorySampler``
polls every ``interval_s`` until its level ends, each poll bounded by ``timeout_s``; a failed poll
is skipped, never fatal: the load test matters more.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass
from typing import Any

import httpx

from bench.stats import ReplicaMemory

MiB = 1024 * 1024

Reading = tuple[float | None, float | None, float | None]  # used, total, reported peak (MiB)


def _mb(value: Any) -> float | None:
    return value / MiB if isinstance(value, int | float) and not isinstance(value, bool) else None


def reading_of(report: Any) -> Reading | None:
    """(used, total, reported peak) in MiB from a HealthReport-shaped dict; None if not one."""
    if not isinstance(report, dict) or (
        "memory" not in report and "peak_memory_bytes" not in report
    ):
        return None
    memory = report.get("memory")
    used = total = None
    if isinstance(memory, dict):
        used, total = _mb(memory.get("used_bytes")), _mb(memory.get("total_bytes"))
    return used, total, _mb(report.get("peak_memory_bytes"))


def _entries(body: Any) -> list[dict[str, Any]]:
    entries = body.get("replicas") if isinstance(body, dict) else body
    if isinstance(entries, dict):
        entries = [{"name": k, **v} for k, v in entries.items() if isinstance(v, dict)]
    return [e for e in entries if isinstance(e, dict)] if isinstance(entries, list) else []


def _name(entry: dict[str, Any], i: int) -> str:
    return str(entry.get("name") or entry.get("url") or f"replica{i}")


def parse_replicas(body: Any) -> dict[str, Reading]:
    """Readings per replica from a router's ``GET /replicas`` (a list, or {"replicas": [...]}).

    Each entry has a ``name`` and the replica's last health report, either inline or under
    ``health``/``report``/``last_health``.
    """
    readings: dict[str, Reading] = {}
    for i, entry in enumerate(_entries(body)):
        for candidate in (
            entry,
            entry.get("health"),
            entry.get("report"),
            entry.get("last_health"),
        ):
            reading = reading_of(candidate)
            if reading is not None:
                readings[_name(entry, i)] = reading
                break
    return readings


@dataclass(frozen=True)
class Target:
    """``replicas``: name -> base URL of each replica (a lone replica is called "replica")."""

    base_url: str
    router: bool
    replicas: dict[str, str]


async def discover(
    client: httpx.AsyncClient, base_url: str, headers: dict[str, str] | None = None
) -> Target:
    base = base_url.rstrip("/")
    try:
        r = await client.get(base + "/replicas", timeout=5.0, headers=headers)
        body = r.json() if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        body = None
    if body is None:
        return Target(base, router=False, replicas={"replica": base})
    urls = {
        _name(e, i): str(e["url"]).rstrip("/")
        for i, e in enumerate(_entries(body))
        if isinstance(e.get("url"), str)
    }
    return Target(base, router=True, replicas=urls)


class MemorySampler:
    def __init__(
        self,
        client: httpx.AsyncClient,
        target: Target,
        *,
        interval_s: float = 0.1,
        timeout_s: float = 2.0,
        headers: dict[str, str] | None = None,
    ) -> None:
        self._client = client
        self._target = target
        self._interval = interval_s
        self._timeout = timeout_s
        self._headers = headers or {}
        self.peaks: dict[str, ReplicaMemory] = {}

    async def _health(self, url: str) -> Reading | None:
        try:
            r = await self._client.get(
                url + "/health", timeout=self._timeout, headers=self._headers
            )
            return reading_of(r.json())  # 503 while loading/draining carries the same body
        except (httpx.HTTPError, ValueError):
            return None

    async def _read(self) -> dict[str, Reading]:
        t = self._target
        if not t.router:
            reading = await self._health(t.base_url)
            return {"replica": reading} if reading is not None else {}
        readings: dict[str, Reading] = {}
        with contextlib.suppress(httpx.HTTPError, ValueError):
            r = await self._client.get(
                t.base_url + "/replicas", timeout=self._timeout, headers=self._headers
            )
            if r.status_code == 200:
                readings = parse_replicas(r.json())
        names = list(t.replicas)
        direct = await asyncio.gather(*(self._health(t.replicas[n]) for n in names))
        for name, reading in zip(names, direct, strict=True):
            if reading is not None:
                readings[name] = reading
        return readings

    async def poll_once(self) -> None:
        for name, (used, total, peak) in (await self._read()).items():
            m = self.peaks.setdefault(name, ReplicaMemory())
            m.samples += 1
            if used is not None:
                m.peak_used_mb = max(used, m.peak_used_mb or 0.0)
            if total is not None:
                m.total_mb = total
            if peak is not None:
                m.reported_peak_mb = max(peak, m.reported_peak_mb or 0.0)

    async def run(self, stop: asyncio.Event) -> None:
        """Poll until ``stop`` is set; one last poll after, so short levels get a sample."""
        while not stop.is_set():
            await self.poll_once()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self._interval)
        await self.poll_once()

    def snapshot(self) -> dict[str, ReplicaMemory]:
        return {k: v.model_copy() for k, v in self.peaks.items()}
