"""The router app: ``create_app(settings, client=None, clock=None, resolver=None)``.

The lifespan owns the pooled ``httpx.AsyncClient`` (unless one is passed in), the health poller
and DNS discovery. Proxied routes are plain ASGI endpoints (``Proxy``); admin routes are FastAPI.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import random
import time
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from common.config import check_url
from router.auth import Keys
from router.discovery import DnsDiscoverer, Resolver, system_resolver
from router.errors import BadRequest, Conflict, UnknownReplica, install_handlers
from router.health import HealthPoller
from router.metrics import CONTENT_TYPE, RouterMetrics
from router.pool import Pool, ReplicaState
from router.proxy import Proxy
from router.requestlog import RequestLog
from router.settings import RouterSettings
from router.transport import KeepAliveTransport

log = logging.getLogger("gpupool.router")

PROXIED = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/generate")


class AddReplica(BaseModel):
    model_config = ConfigDict(extra="forbid")

    url: str
    name: str | None = None


def make_client(
    settings: RouterSettings, transport: httpx.AsyncBaseTransport | None = None
) -> httpx.AsyncClient:
    """One pooled client for every replica; keep-alive connections are reused across requests.

    Without ``transport``, httpx's own pool, with idle connections dropped after 4 s (before
    uvicorn's 5 s keep-alive timeout closes them under the router).
    """
    cfg = settings.router
    return httpx.AsyncClient(
        timeout=httpx.Timeout(cfg.request_timeout_s, connect=cfg.connect_timeout_s),
        transport=transport,
        limits=httpx.Limits(
            max_connections=4096, max_keepalive_connections=1024, keepalive_expiry=4.0
        ),
        trust_env=False,
    )


class RouterApp(FastAPI):
    """FastAPI, with the proxied routes dispatched straight to the proxy.

    The proxied routes skip FastAPI's middleware stack and router (~10% of the router's CPU
    per request); they still get the request-id/log middleware, and answer errors themselves.
    Other methods on those paths fall through to FastAPI (405 in our JSON shape).
    """

    fast_paths: dict[str, tuple[str, ...]]
    fast_app: ASGIApp | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and self.fast_app is not None:
            methods = self.fast_paths.get(scope["path"])
            if methods is not None and scope["method"] in methods:
                await self.fast_app(scope, receive, send)
                return
        await super().__call__(scope, receive, send)


def create_app(
    settings: RouterSettings,
    client: httpx.AsyncClient | None = None,
    clock: Callable[[], float] | None = None,
    resolver: Resolver | None = None,
    *,
    env: Mapping[str, str] | None = None,
    rng: random.Random | None = None,
) -> FastAPI:
    cfg = settings.router
    clock = clock or time.monotonic
    env = os.environ if env is None else env
    pool = Pool()
    for spec in settings.replicas:
        pool.add(
            ReplicaState(
                name=spec.name,
                url=spec.url.rstrip("/"),
                max_concurrency=spec.max_concurrency,
                max_queue=spec.max_queue,
            )
        )
    keys = Keys.from_env(env, cfg.api_keys_env, cfg.admin_keys_env)
    proxy_ref: list[Proxy] = []
    metrics = RouterMetrics(pool, lambda: proxy_ref[0].in_flight if proxy_ref else 0)
    proxy = Proxy(
        pool,
        cfg,
        metrics=metrics,
        keys=keys,
        clock=clock,
        rng=rng or random.Random(),
        max_body_bytes=settings.max_body_bytes,
    )
    proxy_ref.append(proxy)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        owned = client is None
        lean = owned and settings.http_client == "lean"
        transport = KeepAliveTransport() if lean else None
        http = client or make_client(settings, transport)
        proxy.client = http
        proxy.transport = transport
        poller = HealthPoller(
            pool,
            http,
            interval_s=cfg.health_interval_s,
            timeout_s=cfg.health_timeout_s,
            fail_threshold=cfg.fail_threshold,
            success_threshold=cfg.success_threshold,
            foreign_max_concurrency=settings.foreign_max_concurrency,
            foreign_max_queue=settings.foreign_max_queue,
            clock=clock,
        )
        app.state.poller = poller
        tasks: list[asyncio.Task[None]] = []
        if cfg.discovery is not None:
            discoverer = DnsDiscoverer(
                pool,
                cfg.discovery,
                resolver or system_resolver,
                max_concurrency=settings.default_max_concurrency,
                max_queue=settings.default_max_queue,
            )
            app.state.discoverer = discoverer
            await discoverer.refresh()
            tasks.append(asyncio.create_task(discoverer.run()))
        await poller.poll_once()
        tasks.append(asyncio.create_task(poller.run()))
        # Everything built so far lives as long as the process: keep it out of the cyclic GC's
        # scans, which otherwise show up as millisecond pauses in the p99.
        gc.collect()
        gc.freeze()
        log.info(
            "router up: %d replica(s): %s; auth %s",
            len(pool),
            ", ".join(f"{r.name}={r.url} ({r.state})" for r in pool.list()) or "none",
            "on" if keys.enabled else "off",
        )
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            if owned:
                await http.aclose()

    app = RouterApp(title="gpupool router", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.pool = pool
    app.state.proxy = proxy
    app.state.metrics = metrics
    install_handlers(app)

    app.fast_paths = {}
    for path in PROXIED:
        methods = ["GET"] if path == "/v1/models" else ["POST"]
        app.router.routes.append(Route(path, endpoint=proxy, methods=methods))
        app.fast_paths[path] = tuple(methods)
    app.fast_app = RequestLog(proxy, clock)

    def admin(request: Request) -> None:
        keys.check(request.headers.get("authorization"), admin=True)

    @app.get("/health")
    async def health() -> JSONResponse:
        replicas = pool.list()
        ready = sum(1 for r in replicas if r.accepting)
        body = {
            "ready": ready > 0 and not proxy.draining,
            "draining": proxy.draining,
            "in_flight": proxy.in_flight,
            "replicas": len(replicas),
            "ready_replicas": ready,
            "unhealthy_replicas": sum(1 for r in replicas if not r.healthy),
            "loading_replicas": sum(1 for r in replicas if r.healthy and not r.ready),
            "draining_replicas": sum(
                1 for r in replicas if r.draining or r.admin_drained or r.removing
            ),
        }
        status = 200 if body["ready"] else 503
        return JSONResponse(body, status_code=status)

    @app.get("/metrics")
    async def metrics_route() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/replicas")
    async def list_replicas(request: Request) -> dict[str, Any]:
        admin(request)
        return {"replicas": [r.snapshot() for r in pool.list()], "draining": proxy.draining}

    @app.post("/replicas", status_code=201)
    async def add_replica(request: Request, body: AddReplica) -> dict[str, Any]:
        admin(request)
        try:
            url = check_url(body.url)
        except ValueError as exc:
            raise BadRequest(f"url: {exc}") from None
        name = body.name or url.split("://", 1)[1]
        existing = pool.get(name)
        same_url = pool.by_url(url)
        if (existing is not None and not existing.removing) or (
            same_url is not None and same_url is not existing
        ):
            raise Conflict(f"a replica named {name!r} or at {url} is already in the pool")
        replica = pool.add(
            ReplicaState(
                name=name,
                url=url,
                max_concurrency=settings.default_max_concurrency,
                max_queue=settings.default_max_queue,
            )
        )
        await app.state.poller.probe(replica)
        return replica.snapshot()

    @app.delete("/replicas/{name}")
    async def delete_replica(request: Request, name: str) -> dict[str, Any]:
        admin(request)
        replica = pool.remove(name)
        if replica is None:
            raise UnknownReplica(f"no replica named {name!r}")
        return {"name": name, "removed": True, "in_flight": replica.in_flight}

    @app.post("/replicas/{name}/drain")
    async def drain_replica(request: Request, name: str) -> dict[str, Any]:
        return _set_drained(request, name, True)

    @app.post("/replicas/{name}/undrain")
    async def undrain_replica(request: Request, name: str) -> dict[str, Any]:
        return _set_drained(request, name, False)

    def _set_drained(request: Request, name: str, drained: bool) -> dict[str, Any]:
        admin(request)
        replica = pool.get(name)
        if replica is None:
            raise UnknownReplica(f"no replica named {name!r}")
        replica.admin_drained = drained
        return replica.snapshot()

    @app.post("/admin/drain")
    async def drain_router(request: Request) -> dict[str, Any]:
        admin(request)
        proxy.draining = True
        log.info("router draining: new requests get 503; %d in flight", proxy.in_flight)
        return {"draining": True, "in_flight": proxy.in_flight}

    @app.post("/admin/undrain")
    async def undrain_router(request: Request) -> dict[str, Any]:
        admin(request)
        proxy.draining = False
        return {"draining": False, "in_flight": proxy.in_flight}

    # The request-id/log middleware wraps everything, error answers included.
    app.add_middleware(RequestLog, clock=clock)
    return app
