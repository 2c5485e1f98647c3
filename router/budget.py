"""Retry budget: retries may be at most a share of recent requests (plus a small reserve).

A token bucket: each new request deposits ``ratio`` tokens, each retry spends one. A reserve that
refills at ``reserve_per_s`` lets a quiet router still retry; the cap stops a long calm spell from
saving up a burst. So when the whole fleet fails, retries add at most ``ratio`` to the load
instead of multiplying it by ``max_attempts``.
"""

from __future__ import annotations

from collections.abc import Callable


class RetryBudget:
    def __init__(
        self,
        ratio: float,
        clock: Callable[[], float],
        *,
        reserve_per_s: float = 2.0,
        cap: float = 50.0,
    ) -> None:
        self.ratio = ratio
        self.clock = clock
        self.reserve_per_s = reserve_per_s
        self.cap = cap
        self.tokens = min(10.0, cap)
        self._last = clock()

    def _refill(self) -> None:
        now = self.clock()
        self.tokens = min(self.cap, self.tokens + (now - self._last) * self.reserve_per_s)
        self._last = now

    def deposit(self) -> None:
        """A new (first-attempt) request."""
        self.tokens = min(self.cap, self.tokens + self.ratio)

    def try_spend(self) -> bool:
        """Take one retry from the budget; False when it is spent."""
        self._refill()
        if self.tokens >= 1.0 - 1e-9:  # 5 x 0.2 must buy a retry despite rounding
            self.tokens -= 1.0
            return True
        return False
