"""Wire shapes that the router, the replicas and the bench agree on.

Only plain pydantic models live here: no I/O, no torch. A replica serves ``HealthReport`` at
``GET /health``; every error answer, from a replica or the router, is an ``ErrorBody`` (the OpenAI
error shape, so the official SDK shows our message).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

REQUEST_ID_HEADER = "X-Request-ID"


class MemoryInfo(BaseModel):
    """Device memory as NVML sees it (whole GPU, all processes), in bytes."""

    used_bytes: int = Field(ge=0)
    total_bytes: int = Field(ge=0)
    free_bytes: int = Field(ge=0)


class HealthReport(BaseModel):
    """What a replica says about itself at ``GET /health``. Building it never runs the model."""

    ready: bool
    device: str
    model: str
    in_flight: int = Field(ge=0)
    queued: int = Field(ge=0)
    max_concurrency: int = Field(ge=1)
    max_queue: int = Field(ge=0)
    memory: MemoryInfo | None = None
    peak_memory_bytes: int | None = None
    uptime_s: float = 0.0
    draining: bool = False
    # Requests completed since start; the router derives a completion rate from its deltas.
    completed: int = 0
    status: Literal["loading", "ready", "draining", "failed"] = "ready"
    error: str | None = None


ErrorType = Literal[
    "invalid_request_error",  # 400/413/422
    "authentication_error",  # 401
    "not_found_error",  # 404
    "rate_limit_error",  # 429
    "service_unavailable",  # 503
    "timeout_error",  # 504
    "upstream_error",  # 502
    "server_error",  # 500: a bug
]


class ErrorDetail(BaseModel):
    message: str
    type: ErrorType
    param: str | None = None
    code: str | None = None


class ErrorBody(BaseModel):
    """``{"error": {"message": ..., "type": ..., "param": ..., "code": ...}}``"""

    error: ErrorDetail

    @classmethod
    def make(
        cls, message: str, type: ErrorType, *, code: str | None = None, param: str | None = None
    ) -> ErrorBody:
        return cls(error=ErrorDetail(message=message, type=type, code=code, param=param))
