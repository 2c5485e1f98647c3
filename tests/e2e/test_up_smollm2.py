"""The README's promise: `gpupool up` on the default config answers with SmolLM2 via the router."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
import yaml

from tests.integration.up_harness import alive, gpupool_up, processes_mentioning, wait_until
from tests.support import REPO, free_port, free_ports

pytestmark = pytest.mark.slow


def test_default_config_serves_smollm2_through_the_router_to_the_openai_sdk(
    tmp_path: Path,
) -> None:
    openai = pytest.importorskip("openai")
    # configs/local.yaml exactly, but on free ports so it cannot clash with anything running.
    data = yaml.safe_load((REPO / "configs" / "local.yaml").read_text())
    data["replicas"]["port_base"] = free_ports(len(data["replicas"]["devices"]))
    data["router"]["port"] = free_port()
    config = tmp_path / "local.yaml"
    config.write_text(yaml.safe_dump(data))
    with gpupool_up(tmp_path, config, ready_timeout_s=600) as up:
        assert len(up.pids()) == 3  # two replicas and the router
        client = openai.OpenAI(base_url=up.url + "/v1", api_key="unused", timeout=120)
        reply = client.chat.completions.create(
            model="smollm2-135m",
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=16,
        )
        assert reply.choices[0].message.content
        assert reply.usage is not None and reply.usage.completion_tokens > 0
        children = up.pids()
        up.popen.send_signal(signal.SIGTERM)
        assert up.popen.wait(120) == 0
        wait_until(lambda: not any(alive(p) for p in children), 10, "no child left")
        assert processes_mentioning(str(up.state_dir)) == []
