"""Baseline routers (torch-free): random, first fit, most idle."""
from __future__ import annotations

import random
from typing import ClassVar
from typing import Sequence as Seq

from loraplex.daemon.router.base import Router, healthy
from loraplex.daemon.router.state import EngineState, RequestInfo


class RandomRouter(Router):
    """Uniform over healthy engines (seeded, so runs repeat)."""

    name: ClassVar[str] = "random"

    def __init__(self, seed: int = 0) -> None:
        self._rng = random.Random(seed)

    def choose(self, request: RequestInfo, engines: Seq[EngineState]) -> int:
        return self._rng.choice(healthy(engines))


class FirstFitRouter(Router):
    """The first healthy engine with a free batch seat; when all are full, the one with the
    fewest requests."""

    name: ClassVar[str] = "first_fit"

    def choose(self, request: RequestInfo, engines: Seq[EngineState]) -> int:
        candidates = healthy(engines)
        for i in candidates:
            if engines[i].num_requests < engines[i].max_num_seqs:
                return i
        return min(candidates, key=lambda i: (engines[i].num_requests, i))


class MostIdleRouter(Router):
    """The engine that would drain its outstanding work soonest."""

    name: ClassVar[str] = "most_idle"

    def choose(self, request: RequestInfo, engines: Seq[EngineState]) -> int:
        return min(healthy(engines),
                   key=lambda i: (engines[i].pending_tokens / max(engines[i].tokens_per_s, 1e-9),
                                  engines[i].num_requests, i))
