"""Sample replica memory during a level: ``/health`` of a replica, ``/replicas`` of a router.

A ``MemorySampler`` polls every ``interval_s`` until its level ends (each poll bounded by
``timeout_s``) and keeps, per replica, the peak of ``memory.used_bytes`` and of
``peak_memory_bytes``. A failed poll is skipped, never fatal: the load test matters more.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import httpx

from bench.stats import ReplicaMemory

MiB = 1024 * 1024


def _mb(value: Any) -> float | None:
    return value / MiB if isinstance(value, int | float) and not isinstance(value, bool) else None


def _reading(report: Any) -> tuple[float | None, float | None, float | None] | None:
    """(used, total, reported peak) in MiB from a HealthReport-shaped dict; None if not one."""
    if not isinstance(report, dict):
        return None
    memory = report.get("memory")
    used = total = None
    if isinstance(memory, dict):
        used, total = _mb(memory.get("used_bytes")), _mb(memory.get("total_bytes"))
    peak = _mb(report.get("peak_memory_bytes"))
    if "memory" not in report and "peak_memory_bytes" not in report:
        return None
    return used, total, peak


def parse_replicas(body: Any) -> dict[str, tuple[float | None, float | None, float | None]]:
    """Readings per replica from a router's ``GET /replicas`` (a list, or {"replicas": [...]}).

    Each entry has a ``name`` and the replica's last health report, either inline or under
    ``health``/``report``/``last_health``.
    """
    entries = body.get("replicas") if isinstance(body, dict) else body
    if isinstance(entries, dict):
        entries = [{"name": k, **v} for k, v in entries.items() if isinstance(v, dict)]
    readings: dict[str, tuple[float | None, float | None, float | None]] = {}
    if not isinstance(entries, list):
        return readings
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict):
            continue
        name = str(entry.get("name") or entry.get("url") or f"replica{i}")
        for candidate in (
            entry,
            entry.get("health"),
            entry.get("report"),
            entry.get("last_health"),
        ):
            reading = _reading(candidate)
            if reading is not None:
                readings[name] = reading
                break
    return readings


class MemorySampler:
    def __init__(
        self,
        client: httpx.AsyncClient,
        base_url: str,
        *,
        interval_s: float = 0.1,
        timeout_s: float = 2.0,
        headers: dict[str, str] | None = None,
    ) -> None:
        self._client = client
        self._base = base_url.rstrip("/")
        self._interval = interval_s
        self._timeout = timeout_s
        self._headers = headers or {}
        self._router: bool | None = None  # found out at the first poll
        self.peaks: dict[str, ReplicaMemory] = {}

    async def poll_once(self) -> None:
        try:
            readings = await self._read()
        except (httpx.HTTPError, ValueError):
            return
        for name, (used, total, peak) in readings.items():
            m = self.peaks.setdefault(name, ReplicaMemory())
            m.samples += 1
            if used is not None:
                m.peak_used_mb = max(used, m.peak_used_mb or 0.0)
            if total is not None:
                m.total_mb = total
            if peak is not None:
                m.reported_peak_mb = max(peak, m.reported_peak_mb or 0.0)

    async def _read(self) -> dict[str, tuple[float | None, float | None, float | None]]:
        if self._router is not False:
            r = await self._client.get(
                self._base + "/replicas", timeout=self._timeout, headers=self._headers
            )
            if r.status_code == 200:
                self._router = True
                return parse_replicas(r.json())
            if self._router is None and r.status_code in (404, 405):
                self._router = False
            else:
                return {}
        r = await self._client.get(
            self._base + "/health", timeout=self._timeout, headers=self._headers
        )
        reading = _reading(r.json())  # 503 while draining carries the same body
        return {"replica": reading} if reading is not None else {}

    async def run(self, stop: asyncio.Event) -> None:
        """Poll until ``stop`` is set; one last poll after, so short levels get a sample."""
        while not stop.is_set():
            await self.poll_once()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self._interval)
        await self.poll_once()

    def snapshot(self) -> dict[str, ReplicaMemory]:
        return {k: v.model_copy() for k, v in self.peaks.items()}
