"""What one router process runs with: the router section of the YAML plus its replica list."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from common.config import DeploymentConfig, RouterConfig


class ReplicaSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    url: str
    # Until the first report; a gpupool replica then reports its own.
    max_concurrency: int = Field(1, ge=1)
    max_queue: int = Field(32, ge=0)


class RouterSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    router: RouterConfig = Field(default_factory=RouterConfig)
    replicas: list[ReplicaSpec] = Field(default_factory=list)
    # Capacity assumed for a replica added at run time (DNS, POST /replicas) until its report.
    default_max_concurrency: int = Field(1, ge=1)
    default_max_queue: int = Field(32, ge=0)
    # Capacity assumed for a replica whose /health is not a gpupool report (vLLM, TGI...).
    foreign_max_concurrency: int = Field(8, ge=1)
    foreign_max_queue: int = Field(64, ge=0)
    # Bodies above this are answered 413 by the router itself.
    max_body_bytes: int = Field(16_000_000, ge=1024)
    # Upstream HTTP: "lean" (router/transport.py, the default) or "httpx" (httpx's own pool),
    # kept to measure one against the other (docs/BENCHMARKS.md).
    http_client: Literal["lean", "httpx"] = "lean"


def from_deployment(
    config: DeploymentConfig, gpu_indices: list[int] | None = None
) -> RouterSettings:
    """Local replicas by port (named cpu0, gpu3, ... as the launcher names them) and remote ones.

    With ``router.discovery`` set, the replicas are the addresses the DNS name resolves to, and
    ``replicas.devices`` describes what each replica pod runs, not replicas on this host: no
    local replicas then (``gpu_indices`` is not needed).
    """
    local = [] if config.router.discovery is not None else config.replica_settings(gpu_indices)
    specs = [
        ReplicaSpec(
            name=s.name, url=s.url, max_concurrency=s.max_concurrency, max_queue=s.max_queue
        )
        for s in local
    ]
    for name, url in config.remote_endpoints():  # URLs checked when the config was loaded
        specs.append(
            ReplicaSpec(
                name=name,
                url=url,
                max_concurrency=config.replicas.max_concurrency,
                max_queue=config.replicas.max_queue,
            )
        )
    return RouterSettings(
        router=config.router,
        replicas=specs,
        default_max_concurrency=config.replicas.max_concurrency,
        default_max_queue=config.replicas.max_queue,
        max_body_bytes=max(config.model.max_body_bytes * 2, 1024),
    )
