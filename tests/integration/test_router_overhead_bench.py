"""bench/router_overhead.py end to end, tiny: routers side by side, figures for each, no errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.router_overhead import main, parse_router


def test_router_specs() -> None:
    assert parse_router("router") == parse_router("router=router")
    spec = parse_router("httpx=router --http-client=httpx")
    assert (spec.name, spec.module, spec.args) == ("httpx", "router", ["--http-client=httpx"])


def test_two_routers_side_by_side(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "r.json"
    argv = ["--requests=40", "--rounds=2", "--clients=4", "--fixed-ms=1", "--duration-s=0.5"]
    argv += ["--throughput-clients=4", "--router=lean=router"]
    argv += ["--router", "httpx=router --http-client=httpx", f"--json={out}"]
    assert main(argv) == 0
    result = json.loads(out.read_text())
    phases = {p["name"]: p for p in result["phases"]}
    assert set(phases) == {"direct", "lean", "httpx", "direct-max", "lean-max", "httpx-max"}
    assert [phases[n]["requests"] for n in ("direct", "lean", "httpx")] == [40, 40, 40]
    assert all(p["errors"] == 0 for p in phases.values())
    assert phases["lean"]["router_cpu_s"] is not None
    assert set(result["added"]) == {"lean", "httpx"}
    assert "added by httpx" in capsys.readouterr().out
