"""The routing policy: a small pure function over replica state.

``choose`` picks the least-loaded replica that can take a request now; ``refusal`` says why
none could (the caller answers 503 when nothing is ready, 429 when everything ready is full).
"""

from __future__ import annotations

import random
from collections.abc import Collection, Iterable
from enum import Enum

from router.pool import ReplicaState

_EPS = 1e-9


class Refusal(Enum):
    NONE_READY = "none_ready"  # no healthy, ready, non-draining replica: 503
    ALL_FULL = "all_full"  # some are ready, but every one is full or short of memory: 429


def low_memory(replica: ReplicaState, min_free_memory_bytes: int) -> bool:
    """Free device memory below the floor. Unknown memory (CPU, foreign) never counts as low."""
    mem = replica.memory
    return mem is not None and mem.total_bytes > 0 and mem.free_bytes < min_free_memory_bytes


def full(replica: ReplicaState) -> bool:
    """Every slot and every queue place taken (by the router's estimate)."""
    return replica.outstanding >= replica.capacity


def eligible(replica: ReplicaState, min_free_memory_bytes: int) -> bool:
    return (
        replica.accepting and not full(replica) and not low_memory(replica, min_free_memory_bytes)
    )


def choose(
    candidates: Iterable[ReplicaState],
    rng: random.Random,
    *,
    min_free_memory_bytes: int = 0,
    exclude: Collection[str] = (),
) -> ReplicaState | None:
    """The eligible replica with the lowest load; ties broken at random.

    load = outstanding / max_concurrency, so a replica with twice the slots takes twice the
    work before it looks as loaded. ``exclude`` names replicas already tried for this request.
    """
    best: list[ReplicaState] = []
    best_load = 0.0
    for replica in candidates:
        if replica.name in exclude or not eligible(replica, min_free_memory_bytes):
            continue
        load = replica.load
        if not best or load < best_load - _EPS:
            best, best_load = [replica], load
        elif load <= best_load + _EPS:
            best.append(replica)
    if not best:
        return None
    return best[0] if len(best) == 1 else rng.choice(best)


def refusal(candidates: Iterable[ReplicaState], exclude: Collection[str] = ()) -> Refusal:
    """Why ``choose`` found nothing: no replica accepting at all, or all of them full."""
    if any(r.accepting and r.name not in exclude for r in candidates):
        return Refusal.ALL_FULL
    return Refusal.NONE_READY
