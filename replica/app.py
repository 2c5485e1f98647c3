"""``create_app(settings)``: the replica's FastAPI app.

The lifespan loads the engine in a background task, so ``/health`` answers 503 ``loading`` at
once and 200 when the model is ready (``failed`` with the error if loading fails). It owns that
task and the engine, and closes both on shutdown. A simulated source never imports torch.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from common.config import ConfigError, ReplicaSettings
from common.gpu import GpuProbe, NoGpuProbe, NvmlProbe
from common.protocol import REQUEST_ID_HEADER, ErrorBody
from replica.api import router
from replica.engine import Engine
from replica.errors import ModelLoadError, install_handlers
from replica.gate import Gate
from replica.metrics import ReplicaMetrics
from replica.simulated import SimulatedEngine, is_simulated
from replica.state import ReplicaState

log = logging.getLogger("replica")
access_log = logging.getLogger("replica.access")

Clock = Callable[[], float]
_QUIET_PATHS = ("/health", "/metrics")


def build_engine(settings: ReplicaSettings) -> Engine:
    """SimulatedEngine for ``simulated[:...]``, else TransformersEngine (imported only then)."""
    source = settings.model.source
    if is_simulated(source):
        return SimulatedEngine.from_source(source, device=settings.device)
    from replica.transformers_engine import TransformersEngine

    engine: Engine = TransformersEngine(source, settings.device, settings.model.dtype)
    return engine


def build_probe(settings: ReplicaSettings, engine: Engine) -> GpuProbe:
    """The engine's own probe (simulated), NVML for ``cuda[:N]``, none on CPU.

    ConfigError when ``cuda:N`` is not among the GPUs ``CUDA_VISIBLE_DEVICES`` leaves visible."""
    if isinstance(engine, SimulatedEngine):
        return engine.probe
    if settings.device.startswith("cuda"):
        ordinal = int(settings.device[5:]) if settings.device.startswith("cuda:") else 0
        try:
            return NvmlProbe(os.environ, ordinal)
        except ValueError as exc:
            raise ConfigError(f"--device {settings.device}: {exc}") from exc
    return NoGpuProbe()


class RequestContext:
    """Request id in and out, one access-log line and the request metrics per request."""

    def __init__(self, app: ASGIApp, state: ReplicaState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        given = headers.get(REQUEST_ID_HEADER.lower().encode(), b"").decode("latin-1").strip()
        request_id = given[:128] or uuid.uuid4().hex
        start = self.state.clock()
        info: dict[str, Any] = {"id": request_id, "arrival": start}
        scope.setdefault("state", {})["access"] = info
        status = 500
        started = False

        async def send_with_id(message: Message) -> None:
            nonlocal status, started
            if message["type"] == "http.response.start":
                started = True
                status = int(message["status"])
                raw = list(message.get("headers", []))
                raw.append((REQUEST_ID_HEADER.lower().encode(), request_id.encode("latin-1")))
                message = {**message, "headers": raw}
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except Exception as exc:
            if started:
                raise
            # A bug: answer a 500 ErrorBody here, logged once with its traceback.
            log.error("id=%s unhandled error on %s", request_id, scope.get("path"), exc_info=exc)
            body = ErrorBody.make(
                f"internal error: {type(exc).__name__}", "server_error", code="internal_error"
            )
            await JSONResponse(body.model_dump(), status_code=500)(scope, receive, send_with_id)
        finally:
            self._record(scope, info, status, self.state.clock() - start)

    def _record(self, scope: Scope, info: dict[str, Any], status: int, duration_s: float) -> None:
        path = str(scope.get("path", ""))
        m = self.state.metrics
        route = path if path in _ROUTES else "other"
        m.requests.labels(route, str(status)).inc()
        m.request_duration.labels(route).observe(duration_s)
        if status >= 400:
            m.errors.labels(str(status)).inc()
        line = (
            "id=%s %s %s status=%d queue_ms=%s duration_ms=%.1f prompt_tokens=%s "
            "completion_tokens=%s%s"
        )
        args = (
            info["id"],
            scope.get("method", ""),
            path,
            status,
            info.get("queue_ms", "-"),
            duration_s * 1000,
            info.get("prompt_tokens", "-"),
            info.get("completion_tokens", "-"),
            f" stream_error={info['stream_error']}" if "stream_error" in info else "",
        )
        # Probes are logged only at debug, a 503 /health too (loading, draining): pollers ask
        # every second, and the replica logs those state changes once itself.
        quiet = path in _QUIET_PATHS and (status < 400 or (path == "/health" and status == 503))
        level = logging.DEBUG if quiet else logging.INFO
        access_log.log(level, line, *args)


_ROUTES = {
    "/v1/completions",
    "/v1/chat/completions",
    "/generate",
    "/v1/models",
    "/health",
    "/metrics",
    "/admin/drain",
    "/admin/undrain",
}


async def _load(
    state: ReplicaState, on_load_failed: Callable[[BaseException], None] | None
) -> None:
    begin = time.monotonic()
    try:
        await state.engine.load()
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        state.status = "failed"
        state.error = (
            str(exc) if isinstance(exc, ModelLoadError) else f"{type(exc).__name__}: {exc}"
        )
        state.load_exception = exc
        log.error(
            "model %s failed to load: %s",
            state.settings.model.source,
            state.error,
            exc_info=None if isinstance(exc, ModelLoadError) else exc,
        )
        if on_load_failed is not None:
            on_load_failed(exc)
        return
    state.status = "ready"
    log.info(
        "replica %s ready: model %s on %s in %.1f s (max_concurrency=%d, max_queue=%d)",
        state.settings.name,
        state.engine.model_id,
        state.settings.device,
        time.monotonic() - begin,
        state.gate.max_concurrency,
        state.gate.max_queue,
    )


def create_app(
    settings: ReplicaSettings,
    engine: Engine | None = None,
    probe: GpuProbe | None = None,
    clock: Clock = time.monotonic,
    on_load_failed: Callable[[BaseException], None] | None = None,
) -> FastAPI:
    """The replica app. ``engine``/``probe``/``clock`` are seams for tests; ``on_load_failed``
    lets ``__main__`` stop the server when the model cannot load."""
    engine = engine if engine is not None else build_engine(settings)
    probe = probe if probe is not None else build_probe(settings, engine)
    gate = Gate(settings.max_concurrency, settings.max_queue, settings.queue_timeout_s, clock)
    metrics = ReplicaMetrics()
    state = ReplicaState(
        settings=settings,
        engine=engine,
        probe=probe,
        gate=gate,
        metrics=metrics,
        clock=clock,
        started_at=clock(),
    )

    def _memory(attr: str) -> float:
        reading = probe.read()
        return float(getattr(reading, attr)) if reading is not None else 0.0

    metrics.bind(
        in_flight=lambda: gate.in_flight,
        queued=lambda: gate.queued,
        ready=lambda: 1.0 if state.ready else 0.0,
        peak_memory=lambda: float(state.peak_memory_bytes() or 0),
        memory_used=lambda: _memory("used_bytes"),
        memory_total=lambda: _memory("total_bytes"),
    )

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        loader = asyncio.create_task(_load(state, on_load_failed), name="replica-load")
        try:
            yield
        finally:
            gate.drain()
            loader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await loader
            try:
                await engine.close()
            except Exception:
                log.exception("engine close failed")

    app = FastAPI(title=f"gpupool replica {settings.name}", lifespan=lifespan)
    app.state.replica = state
    app.include_router(router)
    install_handlers(app)
    app.add_middleware(RequestContext, state=state)
    return app
