"""A router stopped while requests outlive its drain timeout answers them clearly, not with a 500.

`gpupool up` drains the router before stopping it; what is still running when the drain timeout
ends is cut. A request whose answer had not begun gets 503 with a message; a stream that had
begun ends with an SSE error event, so no client mistakes a cut answer for a complete one.
"""

from __future__ import annotations

import json
import threading
from typing import Any

import httpx

from tests.integration.router_helpers import wait_for
from tests.support import replica_process, router_process

SLOW = "simulated:decode_ms=300,prefill_ms=0"


def _health(url: str) -> dict[str, Any]:
    return dict(httpx.get(url + "/health", timeout=5).json())


def test_requests_cut_by_shutdown_get_503_or_an_sse_error_event_and_no_traceback() -> None:
    results: dict[str, Any] = {}
    first_chunk = threading.Event()
    with (
        replica_process("--model", SLOW, "--max-concurrency", "4") as replica,
        router_process("--replica", f"r0={replica.url}", "--drain-timeout-s", "1") as router,
    ):

        def plain() -> None:
            r = httpx.post(
                router.url + "/generate", json={"text": "hi", "max_tokens": 40}, timeout=60
            )
            results["plain"] = (r.status_code, r.json())

        def stream() -> None:
            body = {"prompt": "hi", "max_tokens": 40, "stream": True}
            lines = []
            with httpx.stream("POST", router.url + "/v1/completions", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    if line:
                        lines.append(line)
                        first_chunk.set()
                results["stream"] = (r.status_code, lines)

        threads = [threading.Thread(target=plain), threading.Thread(target=stream)]
        for t in threads:
            t.start()
        assert first_chunk.wait(20), "the stream never began"
        wait_for(lambda: _health(router.url)["in_flight"] == 2, timeout_s=20)
        router.popen.terminate()
        for t in threads:
            t.join(30)
        assert router.popen.wait(30) is not None
        log = router.log()

    status, body = results["plain"]
    assert status == 503
    assert "shut down" in body["error"]["message"]
    status, lines = results["stream"]
    assert status == 200
    events = [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]
    assert any(e.startswith("{") and "text" in json.loads(e)["choices"][0] for e in events[:-1])
    last = json.loads(events[-1])
    assert "shut down" in last["error"]["message"]
    assert "Traceback" not in log
    assert "Exception in ASGI application" not in log
