"""Router settings from a deployment YAML and from flags."""

from __future__ import annotations

from pathlib import Path

import pytest

from common.config import ConfigError, parse_config
from router.__main__ import build_settings, parse_args
from router.settings import from_deployment


def test_local_devices_and_remote_replicas_become_the_pool() -> None:
    config = parse_config(
        {
            "replicas": {"devices": ["cpu", 3], "port_base": 9200, "max_concurrency": 4},
            "remote_replicas": [{"url": "https://gpu-box:9100/", "name": "box"}],
        }
    )
    settings = from_deployment(config)
    assert [(r.name, r.url, r.max_concurrency) for r in settings.replicas] == [
        ("cpu0", "http://127.0.0.1:9200", 4),
        ("gpu3", "http://127.0.0.1:9201", 4),
        ("box", "https://gpu-box:9100", 4),
    ]


def test_with_dns_discovery_devices_describe_the_pods_not_local_replicas() -> None:
    config = parse_config(
        {
            "replicas": {"devices": "all", "max_concurrency": 8, "max_queue": 64},
            "router": {"discovery": {"name": "gpupool-replicas", "port": 9100}},
        }
    )
    settings = from_deployment(config)  # no GPU list needed: nothing local
    assert settings.replicas == []
    assert (settings.default_max_concurrency, settings.default_max_queue) == (8, 64)


def test_flags_override_the_yaml(tmp_path: Path) -> None:
    config = tmp_path / "d.yaml"
    config.write_text("replicas:\n  devices: [cpu]\nrouter:\n  port: 8100\n  fail_threshold: 5\n")
    args = parse_args(
        [
            "--config",
            str(config),
            "--port",
            "8200",
            "--fail-threshold",
            "3",
            "--replica",
            "extra=http://10.0.0.9:9100",
            "--replica",
            "http://10.0.0.10:9100",
        ]
    )
    settings = build_settings(args)
    assert settings.router.port == 8200 and settings.router.fail_threshold == 3
    assert [r.name for r in settings.replicas] == ["cpu0", "extra", "10.0.0.10:9100"]


def test_bad_flag_values_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="--fail-threshold: must be >= 1"):
        build_settings(parse_args(["--replica", "http://a:1", "--fail-threshold", "0"]))
    # Each of these was a traceback, or accepted (a foreign replica of capacity 0 then failed
    # every request with a ZeroDivisionError).
    bad = {
        "--foreign-max-concurrency: must be >= 1": ["--foreign-max-concurrency", "0"],
        "--max-queue: must be >= 0": ["--max-queue", "-1"],
        "--discover: port: must be an integer": ["--discover", "svc:abc"],
        "URLs repeat": ["--replica", "b=http://a:1/"],
    }
    for problem, flags in bad.items():
        with pytest.raises(ConfigError, match=problem):
            build_settings(parse_args(["--replica", "a=http://a:1", *flags]))
    with pytest.raises(ConfigError, match="repeat"):
        build_settings(parse_args(["--replica", "a=http://a:1", "--replica", "a=http://b:1"]))
    with pytest.raises(ConfigError, match="http:// or https://"):
        build_settings(parse_args(["--replica", "a=ftp://a:1"]))


@pytest.mark.parametrize(
    ("url", "problem"),
    [
        ("http://[::1", "not a valid URL"),
        ("http://host:99999", "not a valid URL"),
        ("http://exa mple:9100", "no valid host"),
        ("http://:9100", "no valid host"),
        ("http://host:0", "port 0"),
        ("http://host:9100/?x=1", "no query"),
    ],
)
def test_bad_replica_urls_are_config_errors_naming_the_url(url: str, problem: str) -> None:
    # Such a URL used to reach the health poller, whose exception stopped it for every replica.
    with pytest.raises(ConfigError, match=problem) as caught:
        build_settings(parse_args(["--replica", f"x={url}"]))
    assert url in str(caught.value)
    with pytest.raises(ConfigError, match=f"remote_replicas.0: .*{problem}"):
        parse_config({"replicas": {"devices": []}, "remote_replicas": [{"url": url}]})


def test_good_replica_urls_pass() -> None:
    args = ["--replica=http://[::1]:9100/", "--replica=https://gpu-box/prefix/", "--replica=h:9"]
    with pytest.raises(ConfigError, match="'h:9'"):
        build_settings(parse_args(args))
    settings = build_settings(parse_args(args[:2]))
    assert [(r.name, r.url) for r in settings.replicas] == [
        ("[::1]:9100", "http://[::1]:9100"),
        ("gpu-box/prefix", "https://gpu-box/prefix"),
    ]
