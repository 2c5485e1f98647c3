"""What the proxy learns from each attempt: live counts, completions, passive ejection.

Rules:

- A failure to connect ejects the replica at once; the poller readmits it after
  ``success_threshold`` good probes.
- Other 5xx answers are passed through to the client (the request may have run) and counted:
  ``fail_threshold`` consecutive 500/502s eject the replica with an exponential back-off
  (``health_interval_s`` x 2^n, at most 60 s), so a replica that fails every request while its
  /health looks fine is kept out of rotation. After the back-off the poller may readmit it, and
  a single further 5xx ejects it again, for longer. A non-5xx answer clears the streak.
  504 is a slow request, not a broken replica, and 503 is retried elsewhere: neither counts.
- A 429 from a replica marks it full, a 503 marks it not ready, until its next report.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from common.config import RouterConfig
from router.health import CompletionRate
from router.pool import Pool, ReplicaState

log = logging.getLogger("gpupool.router.proxy")


class Outcomes:
    def __init__(
        self,
        pool: Pool,
        config: RouterConfig,
        rate: CompletionRate,
        clock: Callable[[], float],
    ) -> None:
        self.pool = pool
        self.config = config
        self.rate = rate
        self.clock = clock

    def release(self, replica: ReplicaState) -> None:
        """The router no longer has this request at the replica."""
        replica.in_flight -= 1
        self.pool.reap(replica)

    def finish(self, replica: ReplicaState, status: int) -> None:
        """The replica answered (and, for a stream, the stream ended) with ``status``."""
        self.release(replica)
        self.rate.record()
        if status >= 500 and status not in (503, 504):
            replica.consecutive_5xx += 1
            if replica.consecutive_5xx >= self.config.fail_threshold:
                backoff = min(self.config.health_interval_s * 2**replica.error_ejections, 60.0)
                replica.error_ejections += 1
                replica.ejected_until = self.clock() + backoff
                self.eject(replica, f"{replica.consecutive_5xx} consecutive {status} answers")
            else:
                self.failed(replica, f"answered {status}")
        elif status < 500:
            replica.consecutive_5xx = 0
            replica.error_ejections = 0

    def refused(self, replica: ReplicaState, status: int) -> None:
        """A replica said 429 (full) or 503 (not ready): believe it until its next report."""
        replica.last_error = f"answered {status}"
        if status == 503:
            replica.ready = False
        else:
            replica.reported_in_flight = replica.max_concurrency
            replica.reported_queued = replica.max_queue
            replica.own_at_report = replica.in_flight

    def failed(self, replica: ReplicaState, reason: str) -> None:
        """An attempt failed in a way that does not, alone, say the replica is down."""
        replica.errors += 1
        replica.last_error = reason

    def eject(self, replica: ReplicaState, reason: str) -> None:
        """Take a replica out of rotation now; the poller readmits it after successes."""
        self.failed(replica, reason)
        replica.consecutive_successes = 0
        if replica.healthy:
            replica.healthy = False
            replica.ejections += 1
            log.warning("ejected replica %s: %s", replica.name, reason)
