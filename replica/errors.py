"""Replica exceptions, and the ONE table that maps them to HTTP answers.

Handlers raise these; ``install_handlers(app)`` turns each into an ``ErrorBody`` JSON answer with
the status from ``STATUS``. Lower layers' errors are translated at the boundary, ``from exc``.
"""

from __future__ import annotations


class ReplicaError(Exception):
    """Base of every error a client may see; ``message`` is shown to the client."""

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class InvalidRequest(ReplicaError):
    """400: a limit or a rule the request broke; the message names the limit and the value."""


class PayloadTooLarge(ReplicaError):
    """413: the body (or the prompt) is larger than the configured cap."""


class QueueFull(ReplicaError):
    """429: every slot busy and the waiting queue full."""

    def __init__(self, message: str, *, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class NotReady(ReplicaError):
    """503: loading, draining, or failed to load."""


class QueueTimeout(ReplicaError):
    """503: waited in the queue longer than queue_timeout_s."""


class EngineOutOfMemory(ReplicaError):
    """503: the device ran out of memory for this request; the replica stays up."""


class GenerationTimeout(ReplicaError):
    """504: generation passed request_timeout_s and was stopped."""


class ModelLoadError(Exception):
    """The model source is missing or broken; raised at start-up, names the source."""
