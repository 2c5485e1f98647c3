"""ARCHITECTURE.md's import rules, checked on the source: a violation fails here, not in review.

- router, replica, bench import common and themselves, never one another;
- deploy imports only common (it starts the others as processes);
- common imports nothing of ours and never torch;
- only replica/models.py and replica/transformers_engine.py import torch or transformers.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
OURS = {"common", "replica", "router", "deploy", "bench"}
ALLOWED = {
    "common": {"common"},
    "replica": {"common", "replica"},
    "router": {"common", "router"},
    "bench": {"common", "bench"},
    "deploy": {"common", "deploy"},
}
TORCH_USERS = {"replica/models.py", "replica/transformers_engine.py"}
HEAVY = {"torch", "transformers", "gguf", "safetensors", "tokenizers"}


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def _sources() -> list[Path]:
    return sorted(p for pkg in OURS for p in (REPO / pkg).rglob("*.py"))


@pytest.mark.parametrize("path", _sources(), ids=lambda p: str(p.relative_to(REPO)))
def test_each_module_imports_only_what_its_package_may(path: Path) -> None:
    rel = path.relative_to(REPO)
    package = rel.parts[0]
    imported = _imports(path)
    forbidden = (imported & OURS) - ALLOWED[package]
    assert not forbidden, f"{rel} imports {sorted(forbidden)}"
    if str(rel) not in TORCH_USERS:
        assert not (imported & HEAVY), f"{rel} imports {sorted(imported & HEAVY)}"


def test_router_launcher_bench_and_a_simulated_replica_never_load_torch() -> None:
    code = (
        "import sys\n"
        "import router.app, router.__main__, deploy.cli, deploy.launcher\n"
        "import bench.ladder, bench.tune\n"
        "import replica.app, replica.__main__\n"
        "from common.config import ReplicaSettings, ModelConfig\n"
        "replica.app.build_engine(ReplicaSettings(model=ModelConfig(source='simulated')))\n"
        "heavy = sorted(m for m in ('torch', 'transformers') if m in sys.modules)\n"
        "print(','.join(heavy))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "", f"loaded {out.stdout.strip()}"
