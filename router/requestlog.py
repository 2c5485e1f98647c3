"""Pure ASGI middleware: accept or create X-Request-ID, return it, log one line per request.

The line: request id, method, path, status, the replica that served it, attempts, duration. A
given id is kept when it is 1-128 characters of ``[A-Za-z0-9._:-]`` (else a new one is made, so
nothing odd reaches the logs). ``GET /health`` and ``GET /metrics`` are logged at DEBUG only:
probes ask every second, and while the router drains its 503s would flood the log.
"""

from __future__ import annotations

import logging
import re
import uuid
from collections.abc import Callable
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from router import wire

log = logging.getLogger("gpupool.router")

_PROBES = ("/health", "/metrics")
_ID_OK = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")


class RequestLog:
    """Pure ASGI middleware: accept or create X-Request-ID, return it, log one line per request."""

    def __init__(self, app: ASGIApp, clock: Callable[[], float]) -> None:
        self.app = app
        self.clock = clock

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = wire.header(scope, b"x-request-id")
        request_id = given if given and _ID_OK.match(given) else uuid.uuid4().hex
        info: dict[str, Any] = scope.setdefault("state", {})
        info["request_id"] = request_id
        status = [0]
        raw_id = request_id.encode()

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
                message["headers"] = [*message.get("headers", ()), (b"x-request-id", raw_id)]
            await send(message)

        started = self.clock()
        try:
            await self.app(scope, receive, send_with_id)
        finally:
            level = logging.DEBUG if scope["path"] in _PROBES else logging.INFO
            if log.isEnabledFor(level):
                log.log(
                    level,
                    "%s %s %s %d replica=%s attempts=%s %.1fms%s",
                    request_id,
                    scope["method"],
                    scope["path"],
                    status[0],
                    info.get("replica", "-"),
                    info.get("attempts", 0),
                    (self.clock() - started) * 1000,
                    f" ({info['status_note']})" if "status_note" in info else "",
                )
