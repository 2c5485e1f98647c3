"""The deployment YAML: a bad file names the field path and the problem, never a traceback."""

from __future__ import annotations

from pathlib import Path

import pytest

from common.config import ConfigError, load_config, parse_config

REPO = Path(__file__).resolve().parents[2]


def error_of(data: object) -> str:
    with pytest.raises(ConfigError) as info:
        parse_config(data, origin="deploy.yaml")
    return str(info.value)


def test_a_bad_value_names_its_field_path_and_the_limit() -> None:
    message = error_of({"replicas": {"max_queue": -1}})
    assert "replicas.max_queue: must be >= 0 (got -1)" in message


def test_an_endless_replica_timeout_is_refused_when_the_file_loads() -> None:
    message = error_of({"replicas": {"request_timeout_s": float("inf")}})
    assert "replicas.request_timeout_s: must be a finite number (got inf)" in message


def test_a_nested_type_error_names_the_full_path() -> None:
    message = error_of({"router": {"discovery": {"name": "x", "port": "http"}}})
    assert "router.discovery.port: must be an integer" in message


def test_unknown_keys_are_errors_not_silently_ignored() -> None:
    message = error_of({"router": {"prot": 8001}, "replica": {}})
    assert "router.prot: unknown key" in message
    assert "replica: unknown key" in message


def test_a_misspelt_key_suggests_the_right_one_at_any_depth() -> None:
    message = error_of(
        {
            "replica": {},
            "replicas": {"max_concurency": 2},
            "router": {"discovery": {"name": "svc", "intervl_s": 2}},
            "remote_replicas": [{"url": "http://b:1", "nmae": "b"}],
        }
    )
    assert "replica: unknown key (did you mean replicas?)" in message
    assert "replicas.max_concurency: unknown key (did you mean max_concurrency?)" in message
    assert "router.discovery.intervl_s: unknown key (did you mean interval_s?)" in message
    assert "remote_replicas.0.nmae: unknown key (did you mean name?)" in message
    # Nothing close: no guess.
    assert "router.zzz: unknown key (check the spelling" in error_of({"router": {"zzz": 1}})


def test_every_problem_is_reported_at_once() -> None:
    message = error_of({"model": {"max_new_tokens": 0}, "replicas": {"max_concurrency": 0}})
    assert "model.max_new_tokens" in message
    assert "replicas.max_concurrency" in message


def test_router_port_inside_the_replica_range_is_a_conflict() -> None:
    message = error_of(
        {"replicas": {"devices": ["cpu"] * 3, "port_base": 8000}, "router": {"port": 8002}}
    )
    assert "router.port: 8002 collides with the replica ports 8000-8002" in message


def test_replica_ports_past_65535_are_refused() -> None:
    message = error_of({"replicas": {"devices": ["cpu", "cpu"], "port_base": 65535}})
    assert "replicas.port_base" in message and "65535" in message


def test_remote_replica_names_must_not_repeat() -> None:
    twins = [{"url": "http://a:1", "name": "x"}, {"url": "http://b:2", "name": "x"}]
    message = error_of({"remote_replicas": twins})
    assert "names repeat" in message


def test_remote_replica_url_is_checked_before_anything_starts() -> None:
    assert "remote_replicas.0: 'gpu-b:9100': the URL must start with http://" in error_of(
        {"remote_replicas": [{"url": "gpu-b:9100"}]}
    )
    assert "is not a valid URL" in error_of({"remote_replicas": [{"url": "http://[::1"}]})
    assert "no valid host" in error_of({"remote_replicas": [{"url": "http://"}]})
    config = parse_config({"remote_replicas": [{"url": "http://gpu-b:9100/"}]})
    assert config.remote_endpoints() == [("remote0", "http://gpu-b:9100")]


@pytest.mark.parametrize(
    ("devices", "expected"),
    [
        (["cpu", "cpu"], [("cpu0", "cpu", None), ("cpu1", "cpu", None)]),
        ([0, 2], [("gpu0", "cuda", "0"), ("gpu2", "cuda", "2")]),
        ([1, "cpu"], [("gpu1", "cuda", "1"), ("cpu0", "cpu", None)]),
    ],
)
def test_devices_list_gives_one_replica_per_entry_on_consecutive_ports(
    devices: list[object], expected: list[tuple[str, str, str | None]]
) -> None:
    cfg = parse_config({"replicas": {"devices": devices, "port_base": 9200}})
    settings = cfg.replica_settings()
    assert [(s.name, s.device, s.cuda_visible_devices) for s in settings] == expected
    assert [s.port for s in settings] == [9200 + i for i in range(len(devices))]


def test_devices_all_takes_the_gpu_indices_found() -> None:
    cfg = parse_config({"replicas": {"devices": "all"}})
    assert [s.name for s in cfg.replica_settings([0, 1, 3])] == ["gpu0", "gpu1", "gpu3"]
    with pytest.raises(ConfigError, match="no GPU was found"):
        cfg.replica_settings([])


@pytest.mark.parametrize(
    ("devices", "problem"),
    [
        ([], "at least one entry"),
        ([0, 0], "repeat"),
        (["gpu0"], 'entry 0 must be a GPU index (0, 1, ...) or "cpu"'),
        ([-1], "entry 0 must be a GPU index"),
        ("some", 'must be "all" or a list'),
    ],
)
def test_bad_devices_are_explained(devices: object, problem: str) -> None:
    message = error_of({"replicas": {"devices": devices}})
    assert "devices" in message and problem in message


def test_a_file_that_is_not_yaml_or_not_a_mapping_is_a_clear_error(tmp_path: Path) -> None:
    broken = tmp_path / "broken.yaml"
    broken.write_text("model: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(broken)
    scalar = tmp_path / "scalar.yaml"
    scalar.write_text("42\n")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(scalar)
    with pytest.raises(ConfigError, match="no such file"):
        load_config(tmp_path / "missing.yaml")
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(ConfigError, match="not UTF-8 text"):
        load_config(binary)


@pytest.mark.parametrize("name", ["local.yaml", "multi-gpu.yaml", "multi-host.yaml"])
def test_the_shipped_configs_load(name: str) -> None:
    cfg = load_config(REPO / "configs" / name)
    assert cfg.model.source == "builtin:smollm2-135m"


def test_local_yaml_is_two_cpu_replicas_and_a_loopback_router_on_8000() -> None:
    cfg = load_config(REPO / "configs" / "local.yaml")
    assert [s.name for s in cfg.replica_settings()] == ["cpu0", "cpu1"]
    assert (cfg.router.host, cfg.router.port) == ("127.0.0.1", 8000)


def test_multi_host_yaml_names_its_remote_replicas() -> None:
    cfg = load_config(REPO / "configs" / "multi-host.yaml")
    assert cfg.replicas.devices == "all"
    assert [name for name, _ in cfg.remote_endpoints()] == ["gpu-b-0", "gpu-b-1", "gpu-c-0"]


@pytest.mark.parametrize(
    ("text", "line"),
    [
        (
            "replicas:\n  max_concurrency: yes\n",
            "replicas.max_concurrency: must be a number, not true",
        ),
        (
            "replicas:\n  queue_timeout_s: off\n",
            "replicas.queue_timeout_s: must be a number, not false",
        ),
        ("model: builtin:smollm2-135m\n", "model: must be a mapping (indented key: value lines)"),
        ("remote_replicas:\n  - http://gpu-b:9100\n", "remote_replicas.0: must be a mapping"),
        ("model:\n  dtype: fp16\n", "model.dtype: must be one of 'auto', 'bfloat16', 'float16' or"),
        ("replicas:\n  max_queue: 2.5\n", "replicas.max_queue: must be a whole number (got 2.5)"),
        ("model:\n  source: ''\n", "model.source: must not be empty"),
        ("router:\n  host: ''\n", "router.host: must not be empty"),
        ("router:\n  discovery: {name: ''}\n", "router.discovery.name: must not be empty"),
        (
            "replicas:\n  devices: [0, cpu, 0]\n",
            "replicas.devices: GPU indices repeat: [0, 'cpu', 0]",
        ),
    ],
)
def test_typos_and_wrong_shapes_name_the_field_in_our_words(
    tmp_path: Path, text: str, line: str
) -> None:
    path = tmp_path / "typo.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert line in message
    assert "Input should" not in message and "instance of" not in message  # no pydantic jargon


def test_an_empty_device_list_is_a_router_only_host_and_needs_somewhere_to_route() -> None:
    assert "give at least one entry" in error_of({"replicas": {"devices": []}})
    remote = [{"url": "http://gpu-b:9100", "name": "b0"}]
    cfg = parse_config({"replicas": {"devices": []}, "remote_replicas": remote})
    assert cfg.replica_settings() == []
    assert cfg.remote_endpoints() == [("b0", "http://gpu-b:9100")]
    found = parse_config({"replicas": {"devices": []}, "router": {"discovery": {"name": "svc"}}})
    assert found.replica_settings() == []
