"""The router of deploy/kubernetes, run as it is shipped: it finds replicas by DNS and only so.

The ConfigMap's router.yaml is used unchanged but for three values a laptop needs: loopback for
the bind address, `localhost` for the headless Service's name, and a free port.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import yaml

from tests.support import REPO, replica_process, router_process

CONFIGMAP = REPO / "deploy" / "kubernetes" / "configmap.yaml"


def test_the_shipped_router_config_serves_through_a_replica_found_by_dns(tmp_path: Path) -> None:
    with replica_process("--model", "simulated:decode_ms=0", "--name", "pod0") as rep:
        data = yaml.safe_load(yaml.safe_load(CONFIGMAP.read_text())["data"]["router.yaml"])
        data["router"]["host"] = "127.0.0.1"
        data["router"]["discovery"].update(name="localhost", port=rep.port, interval_s=0.5)
        config = tmp_path / "router.yaml"
        config.write_text(yaml.safe_dump(data))
        # router_process returns once /health is 200: a replica was found and is ready.
        with router_process("--config", str(config)) as router:
            body = httpx.get(router.url + "/replicas", timeout=5).json()
            urls = [r["url"] for r in body["replicas"]]
            # Only what DNS named: no local replica from the file (localhost may add ::1 too).
            assert rep.url in urls
            assert all(u.endswith(f":{rep.port}") for u in urls), urls
            answer = httpx.post(
                router.url + "/generate", json={"text": "hi", "max_tokens": 2}, timeout=30
            )
            assert answer.status_code == 200, answer.text
