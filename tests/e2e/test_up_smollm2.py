"""The README's promise: `gpupool up` on the default config answers with SmolLM2 via the router."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.support import REPO, free_port, wait_http

pytestmark = pytest.mark.slow


def test_default_config_serves_smollm2_through_the_router_to_the_openai_sdk(
    tmp_path: Path,
) -> None:
    openai = pytest.importorskip("openai")
    # configs/local.yaml exactly, but on free ports so it cannot clash with anything running.
    data = yaml.safe_load((REPO / "configs" / "local.yaml").read_text())
    data["replicas"]["port_base"] = free_port()
    data["router"]["port"] = port = free_port()
    config = tmp_path / "local.yaml"
    config.write_text(yaml.safe_dump(data))
    env = {**os.environ, "GPUPOOL_STATE_DIR": str(tmp_path / "state"), "PYTHONPATH": str(REPO)}
    log = (tmp_path / "up.log").open("wb")
    popen = subprocess.Popen(
        [sys.executable, "-m", "deploy", "up", str(config)],
        cwd=REPO,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        try:
            wait_http(url + "/health", 600)
        except TimeoutError as exc:
            raise AssertionError((tmp_path / "up.log").read_text()[-4000:]) from exc
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", timeout=120)
        reply = client.chat.completions.create(
            model="smollm2-135m",
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=16,
        )
        assert reply.choices[0].message.content
        assert reply.usage is not None and reply.usage.completion_tokens > 0
        popen.send_signal(signal.SIGTERM)
        assert popen.wait(120) == 0
    finally:
        if popen.poll() is None:
            popen.kill()
            popen.wait(10)
        log.close()
