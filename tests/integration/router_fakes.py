"""Stand-in replicas the real one cannot play, run as processes:

``python -m tests.integration.router_fakes --port P --mode MODE``

- ``error500``: /health is a healthy gpupool report, every other route answers 500
  (a replica broken in a way only real requests reveal).
- ``foreign``: /health is an empty 200 (as vLLM's), /v1/completions answers a fixed completion.
- ``busy429``: /health is a healthy, idle report, every other route answers 429 with
  ``Retry-After: 7`` (a replica whose queue is full of someone else's work).
- ``stall``: /health is a healthy report; every other route sends its head and part of a JSON
  body, then nothing more until the client goes away (counted as ``gone`` in ``/count``).

``GET /count`` says how many proxied requests arrived (and, for ``stall``, how many left).
"""

from __future__ import annotations

import argparse

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send


class _Stall(Response):
    """A 200 whose body stops half-way; counts the client leaving."""

    def __init__(self, count: dict[str, int]) -> None:
        super().__init__()
        self.count = count

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        head = [(b"content-type", b"application/json"), (b"content-length", b"100")]
        await send({"type": "http.response.start", "status": 200, "headers": head})
        await send({"type": "http.response.body", "body": b'{"partial": ', "more_body": True})
        while (await receive())["type"] != "http.disconnect":
            pass
        self.count["gone"] += 1


def build(mode: str) -> Starlette:
    count = {"n": 0, "gone": 0}

    async def health(request: Request) -> Response:
        if mode == "foreign":
            return Response(b"", status_code=200)
        return JSONResponse(
            {
                "ready": True,
                "device": "cpu",
                "model": "broken",
                "in_flight": 0,
                "queued": 0,
                "max_concurrency": 4,
                "max_queue": 4,
            }
        )

    async def work(request: Request) -> Response:
        count["n"] += 1
        await request.body()
        if mode == "stall":
            return _Stall(count)
        if mode == "error500":
            return JSONResponse(
                {"error": {"message": "boom", "type": "server_error"}}, status_code=500
            )
        if mode == "busy429":
            return JSONResponse(
                {"error": {"message": "queue full", "type": "rate_limit_error"}},
                status_code=429,
                headers={"Retry-After": "7"},
            )
        return JSONResponse(
            {
                "id": "cmpl-foreign",
                "object": "text_completion",
                "created": 0,
                "model": "foreign",
                "choices": [{"index": 0, "text": "foreign", "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
            }
        )

    async def counter(request: Request) -> Response:
        return JSONResponse(count)

    return Starlette(
        routes=[
            Route("/health", health),
            Route("/count", counter),
            Route("/v1/completions", work, methods=["POST"]),
            Route("/v1/chat/completions", work, methods=["POST"]),
            Route("/generate", work, methods=["POST"]),
        ]
    )


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--mode", choices=["error500", "foreign", "busy429", "stall"], required=True)
    args = p.parse_args()
    uvicorn.run(build(args.mode), host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
