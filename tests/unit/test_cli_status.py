"""`gpupool status`'s table: the router's view joined with the launcher's restart counts."""

from __future__ import annotations

from typing import Any

from rich.console import Console

from deploy.status import build_table, local_router_port


def render(replicas: list[dict[str, Any]], launcher: dict[str, Any] | None) -> str:
    console = Console(width=200, record=True)
    with console.capture() as capture:
        console.print(build_table(replicas, launcher, "http://127.0.0.1:8000"))
    return capture.get()


ROUTER_VIEW: list[dict[str, Any]] = [
    {
        "name": "gpu0",
        "url": "http://127.0.0.1:9100",
        "state": "ready",
        "load": 1.5,
        "reported_in_flight": 2,
        "reported_queued": 1,
        "memory": {"used_bytes": 30 * 1024**3, "total_bytes": 80 * 1024**3, "free_bytes": 1},
    },
    {"name": "gpu1", "url": "http://127.0.0.1:9101", "state": "unhealthy", "memory": None},
]
LAUNCHER: dict[str, Any] = {
    "children": [
        {"name": "gpu0", "kind": "replica", "url": "http://127.0.0.1:9100", "restarts": 0,
         "state": "ready"},
        {"name": "gpu1", "kind": "replica", "url": "http://127.0.0.1:9101", "restarts": 3,
         "state": "backoff"},
        {"name": "gpu2", "kind": "replica", "url": "http://127.0.0.1:9102", "restarts": 5,
         "state": "down"},
        {"name": "router", "kind": "router", "url": "http://127.0.0.1:8000", "restarts": 0,
         "state": "ready"},
    ]
}  # fmt: skip


def rows(text: str) -> dict[str, str]:
    return {line.split("│")[1].strip(): line for line in text.splitlines() if line.count("│") > 2}


def test_each_replica_shows_state_load_queue_memory_and_restarts() -> None:
    table = rows(render(ROUTER_VIEW, LAUNCHER))
    gpu0 = [cell.strip() for cell in table["gpu0"].split("│")[1:-1]]
    assert gpu0 == ["gpu0", "ready", "1.50", "2", "1", "30.0/80.0 GiB", "0",
                    "http://127.0.0.1:9100"]  # fmt: skip
    assert "unhealthy (restarting)" in table["gpu1"] and "│        3 │" in table["gpu1"]


def test_a_replica_the_launcher_gave_up_on_is_listed_even_if_the_router_lacks_it() -> None:
    table = rows(render(ROUTER_VIEW, LAUNCHER))
    assert "not routed (down)" in table["gpu2"]
    assert "router" not in table  # only replicas are rows


def test_without_a_launcher_restarts_are_unknown() -> None:
    table = rows(render(ROUTER_VIEW, None))
    assert [c.strip() for c in table["gpu0"].split("│")[1:-1]][6] == "-"


def test_restarts_are_looked_up_only_for_a_router_on_this_machine() -> None:
    assert local_router_port("http://127.0.0.1:8123") == 8123
    assert local_router_port("http://localhost") == 80
    # Another host's router: this machine's `gpupool up` on the same port is not its launcher.
    assert local_router_port("http://10.0.0.5:8000") is None
    assert local_router_port("https://gpupool.example.com") is None
