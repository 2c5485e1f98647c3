"""The Kubernetes manifests: valid offline against the bundled schemas, and wired together."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from common.config import DeploymentConfig, parse_config

K8S = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes"
FILES = sorted(K8S.glob("*.yaml"))


def resources() -> dict[str, dict[str, Any]]:
    found = {}
    for path in FILES:
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                found[f"{doc['kind']}/{doc['metadata']['name']}"] = doc
    return found


def container(resource: dict[str, Any]) -> dict[str, Any]:
    containers = resource["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    return dict(containers[0])


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_every_manifest_is_valid_against_the_kubernetes_schema_offline(path: Path) -> None:
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
    assert docs
    for doc in docs:
        # strict: unknown fields are errors too. Schemas ship with the package: no network.
        kubernetes_validate.validate(doc, kubernetes_validate.latest_version(), strict=True)


def test_a_misspelt_field_is_caught_so_the_validation_above_can_fail() -> None:
    bad = resources()["Deployment/gpupool-router"]
    bad = {**bad, "spec": {**bad["spec"], "replicaz": 2}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, kubernetes_validate.latest_version(), strict=True)


def config_of(resource: dict[str, Any]) -> DeploymentConfig:
    """The deployment YAML a pod's command reads: its --config path inside the mounted ConfigMap."""
    c = container(resource)
    path = c["command"][c["command"].index("--config") + 1]
    mount = next(m for m in c["volumeMounts"] if path.startswith(m["mountPath"] + "/"))
    volume = next(
        v for v in resource["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"]
    )
    configmap = resources()[f"ConfigMap/{volume['configMap']['name']}"]
    key = path[len(mount["mountPath"]) + 1 :]
    assert key in configmap["data"], f"{path}: no key {key!r} in the ConfigMap"
    return parse_config(yaml.safe_load(configmap["data"][key]))


def test_the_router_discovers_the_headless_service_by_dns_and_has_no_local_replica() -> None:
    found = resources()
    cfg = config_of(found["Deployment/gpupool-router"])
    headless = found["Service/gpupool-replicas"]
    assert headless["spec"]["clusterIP"] == "None"
    assert cfg.router.discovery is not None
    assert cfg.router.discovery.name == headless["metadata"]["name"]
    assert cfg.router.discovery.port == headless["spec"]["ports"][0]["port"]
    assert cfg.router.host == "0.0.0.0"
    # A local replica here would be a dead 127.0.0.1 entry in the router pod's pool.
    assert cfg.replica_settings() == []
    # Discovered pods start with the capacity the pods really have, until they report it.
    pods = config_of(found["StatefulSet/gpupool-replica"]).replicas
    assert (cfg.replicas.max_concurrency, cfg.replicas.max_queue) == (
        pods.max_concurrency,
        pods.max_queue,
    )


def test_the_replica_pod_runs_the_replica_its_config_names_on_the_services_port() -> None:
    found = resources()
    sts = found["StatefulSet/gpupool-replica"]
    c = container(sts)
    name = c["command"][c["command"].index("--replica") + 1]
    settings = {s.name: s for s in config_of(sts).replica_settings()}
    assert name in settings
    assert settings[name].host == "0.0.0.0"
    assert settings[name].port == c["ports"][0]["containerPort"]
    assert settings[name].port == found["Service/gpupool-replicas"]["spec"]["ports"][0]["port"]


def test_each_replica_pod_has_one_gpu_probes_and_a_drain_shorter_than_its_grace() -> None:
    sts = resources()["StatefulSet/gpupool-replica"]
    c = container(sts)
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert c["readinessProbe"]["httpGet"]["path"] == "/health"
    assert "livenessProbe" in c
    stop = c["lifecycle"]["preStop"]["exec"]["command"]
    assert stop[:3] == ["python", "-m", "deploy.drain"]
    drain_s = float(stop[stop.index("--timeout-s") + 1])
    assert sts["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > drain_s
    assert sts["spec"]["serviceName"] == "gpupool-replicas"


def test_the_router_drains_within_its_grace_period_and_the_service_reaches_it() -> None:
    found = resources()
    router = found["Deployment/gpupool-router"]
    cfg = config_of(router)
    c = container(router)
    grace = router["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace > cfg.router.drain_timeout_s
    assert c["readinessProbe"]["httpGet"]["path"] == "/health"
    assert c["ports"][0]["containerPort"] == cfg.router.port
    service = found["Service/gpupool"]
    assert service["spec"]["selector"] == router["spec"]["selector"]["matchLabels"]
