"""The pure parts of `gpupool up`: what it starts, when it restarts, whether a GPU has room."""

from __future__ import annotations

import subprocess
from collections.abc import Sequence
from pathlib import Path

import pytest

from common.config import ConfigError, parse_config
from common.gpu import GpuInfo
from common.protocol import MemoryInfo
from deploy.plan import (
    MIB,
    PROJECT_ROOT,
    RestartPolicy,
    backoff_delay,
    build_children,
    child_env,
    resolve_devices,
    room_problems,
)
from deploy.preflight import PreflightError, Runner, check_gpu_room

GIB = 1024 * MIB


def gpu(index: int, free_gib: float, total_gib: float = 80) -> GpuInfo:
    total = int(total_gib * GIB)
    free = int(free_gib * GIB)
    return GpuInfo(
        index=index,
        name="H100",
        uuid=f"GPU-{index}",
        memory=MemoryInfo(used_bytes=total - free, total_bytes=total, free_bytes=free),
    )


def test_children_are_the_replicas_then_the_router_with_their_own_argv() -> None:
    cfg = parse_config(
        {"replicas": {"devices": [3, "cpu"], "port_base": 9300}, "router": {"port": 8100}}
    )
    specs = build_children(cfg, Path("/run/up.yaml"), "/py")
    assert [s.name for s in specs] == ["gpu3", "cpu0", "router"]
    argv = ("/py", "-m", "replica", "--config", "/run/up.yaml", "--replica", "gpu3")
    assert specs[0].argv == argv
    # Pinned by NVML index, with CUDA told to number GPUs as NVML does (PCI bus order).
    assert specs[0].env == {"CUDA_VISIBLE_DEVICES": "3", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    assert specs[1].env == {}  # a CPU replica sees whatever the launcher sees
    assert specs[2].argv == ("/py", "-m", "router", "--config", "/run/up.yaml")
    assert [s.url for s in specs] == [
        "http://127.0.0.1:9300",
        "http://127.0.0.1:9301",
        "http://127.0.0.1:8100",
    ]


def test_a_router_on_all_interfaces_is_probed_on_loopback() -> None:
    cfg = parse_config({"router": {"host": "0.0.0.0", "port": 8123}})
    router = build_children(cfg, Path("c.yaml"), "py")[-1]
    assert (router.host, router.url) == ("0.0.0.0", "http://127.0.0.1:8123")


def test_child_env_can_import_gpupool_and_keeps_the_callers_path() -> None:
    env = child_env({"CUDA_VISIBLE_DEVICES": "1"}, {"PYTHONPATH": "/x", "HOME": "/h"})
    assert env["PYTHONPATH"].split(":") == [str(PROJECT_ROOT), "/x"]
    assert env["CUDA_VISIBLE_DEVICES"] == "1"
    assert env["HOME"] == "/h"
    assert env["PYTHONUNBUFFERED"] == "1"


def test_devices_all_resolves_to_every_gpu_nvml_sees() -> None:
    cfg = parse_config({"replicas": {"devices": "all"}})
    resolved = resolve_devices(cfg, [gpu(0, 70), gpu(1, 70)], None)
    assert resolved.replicas.devices == [0, 1]
    assert [s.name for s in resolved.replica_settings()] == ["gpu0", "gpu1"]


def test_devices_all_is_checked_for_port_collisions_once_the_gpus_are_counted() -> None:
    cfg = parse_config(
        {"replicas": {"devices": "all", "port_base": 9100}, "router": {"port": 9102}}
    )
    assert resolve_devices(cfg, [gpu(0, 70), gpu(1, 70)], None).router.port == 9102
    with pytest.raises(ConfigError, match=r"router\.port: 9102 collides with the replica ports"):
        resolve_devices(cfg, [gpu(0, 70), gpu(1, 70), gpu(2, 70)], None)


def test_devices_all_without_a_gpu_is_a_clear_error_with_nvmls_reason() -> None:
    cfg = parse_config({"replicas": {"devices": "all"}})
    with pytest.raises(ConfigError, match=r'"all" but no GPU was found \(driver not loaded\)'):
        resolve_devices(cfg, [], "driver not loaded")


def test_a_listed_gpu_that_does_not_exist_is_named() -> None:
    cfg = parse_config({"replicas": {"devices": [0, 5]}})
    with pytest.raises(ConfigError, match=r"GPU 5 not found \(GPUs present: 0, 1\)"):
        resolve_devices(cfg, [gpu(0, 70), gpu(1, 70)], None)


def test_backoff_doubles_from_one_second_up_to_the_cap() -> None:
    assert [backoff_delay(n, 1.0, 30.0) for n in range(1, 8)] == [1, 2, 4, 8, 16, 30, 30]


def test_a_child_that_keeps_crashing_is_given_up_after_max_restarts() -> None:
    policy = RestartPolicy(max_restarts=3, base_s=1.0, stable_s=60.0)
    delays = []
    now = 0.0
    for _ in range(4):
        delays.append(policy.on_exit(started_at=now, now=now + 1.0))
        now += 2.0
    assert delays == [1.0, 2.0, 4.0, None]


def test_a_child_that_ran_stably_before_crashing_starts_a_fresh_count() -> None:
    policy = RestartPolicy(max_restarts=2, base_s=1.0, stable_s=60.0)
    assert policy.on_exit(started_at=0.0, now=1.0) == 1.0
    assert policy.on_exit(started_at=2.0, now=3.0) == 2.0
    # Up for an hour this time: not the third crash in a row.
    assert policy.on_exit(started_at=4.0, now=3604.0) == 1.0


def test_max_restarts_zero_never_restarts() -> None:
    assert RestartPolicy(max_restarts=0).on_exit(started_at=0.0, now=100.0) is None


def test_room_check_names_each_gpu_without_space_for_weights_plus_headroom() -> None:
    gpus = [gpu(0, 10), gpu(1, 1.5), gpu(2, 2.0)]
    # 1 GiB of weights + 1024 MiB headroom = exactly 2 GiB needed.
    problems = room_problems(gpus, [0, 1, 2], weights_bytes=GIB, headroom_mb=1024)
    assert len(problems) == 1
    assert problems[0].startswith("GPU 1 (H100): 1,536 MiB free")
    assert "1,024 MiB + 1,024 MiB headroom" in problems[0]


def test_room_check_only_looks_at_the_gpus_in_use() -> None:
    assert room_problems([gpu(0, 0.1), gpu(1, 50)], [1], weights_bytes=GIB, headroom_mb=0) == []


def _runner(stdout: str, returncode: int = 0) -> tuple[list[list[str]], Runner]:
    calls: list[list[str]] = []

    def run(argv: Sequence[str], timeout_s: float) -> subprocess.CompletedProcess[str]:
        calls.append(list(argv))
        return subprocess.CompletedProcess(list(argv), returncode, stdout, "")

    return calls, run


def test_gpu_room_check_asks_for_the_estimate_at_the_configured_dtype_and_refuses() -> None:
    cfg = parse_config(
        {"model": {"dtype": "float16"}, "replicas": {"devices": [0, 1], "headroom_mb": 1024}}
    )
    calls, run = _runner(f"{3 * GIB}\n")
    with pytest.raises(PreflightError, match=r"not enough GPU memory:\n  GPU 1 \(H100\)"):
        check_gpu_room(cfg, [gpu(0, 40), gpu(1, 3.5)], "py", run)
    assert calls == [["py", "-m", "replica.models", "estimate", "builtin:smollm2-135m",
                      "--dtype", "float16"]]  # fmt: skip
    check_gpu_room(cfg, [gpu(0, 40), gpu(1, 4.0)], "py", run)  # exactly enough: accepted


def test_cpu_and_simulated_deployments_skip_the_gpu_room_check() -> None:
    calls, run = _runner("not a number")
    check_gpu_room(parse_config({"replicas": {"devices": ["cpu"]}}), [], "py", run)
    simulated = parse_config({"model": {"source": "simulated"}, "replicas": {"devices": [0]}})
    check_gpu_room(simulated, [gpu(0, 0.1)], "py", run)
    assert calls == []


def test_an_estimate_that_fails_is_a_clear_error() -> None:
    _, run = _runner("", returncode=2)
    with pytest.raises(PreflightError, match="cannot estimate its size"):
        check_gpu_room(parse_config({"replicas": {"devices": [0]}}), [gpu(0, 40)], "py", run)


def test_config_path_defaults_to_configs_local_yaml_here_then_to_the_shipped_one(
    tmp_path: Path,
) -> None:
    from deploy.launcher import resolve_config_path

    shipped = PROJECT_ROOT / "configs" / "local.yaml"
    assert resolve_config_path(None, tmp_path) == shipped
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "local.yaml").write_text("{}\n")
    assert resolve_config_path(None, tmp_path) == tmp_path / "configs" / "local.yaml"
    assert resolve_config_path("x/../my.yaml", tmp_path) == tmp_path / "my.yaml"
