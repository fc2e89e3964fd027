"""The operator's switches over a running daemon: set by admin orders, SIGHUP and drain,
read by the step loops, request admission, engine bring-up and the host warm-up."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class Controls:
    policy: str  # the scheduling policy each engine's scheduler runs (switched between two steps)
    cache_policy: str  # the GPU adapter cache's eviction policy
    router: str  # which engine a new request goes to
    paused: bool = False  # requests queue up, no new step starts
    draining: bool = False  # no new request is admitted; those in flight run to their end
