"""Routing across engine replicas (torch-free): `make_router(name).choose(request, engines)`
picks an engine index; `.rebalance(engines)` proposes request-adapter migrations.

Routers: random, first_fit, most_idle (simple.py), rank_aware (rank_aware.py,
Toppings Algorithm 1), dlora (dlora.py, proactive dispatch + co-migration).
"""
from __future__ import annotations

from typing import Any

from loraplex.daemon.router.base import NoEngineError, Router
from loraplex.daemon.router.dlora import DloraRouter, pending_s
from loraplex.daemon.router.rank_aware import KernelCost, PerfProfile, RankAwareRouter
from loraplex.daemon.router.simple import FirstFitRouter, MostIdleRouter, RandomRouter
from loraplex.daemon.router.state import EngineRequest, EngineState, Migration, RequestInfo

ROUTERS: dict[str, type[Router]] = {
    cls.name: cls for cls in (RandomRouter, FirstFitRouter, MostIdleRouter, RankAwareRouter, DloraRouter)
}


def make_router(name: str, **options: Any) -> Router:
    """The router called `name`, built with its keyword options (e.g. rank_aware:
    profile=PerfProfile.load(path), kernel="bgmv", slo_ms=36.0)."""
    cls = ROUTERS.get(name)
    if cls is None:
        raise ValueError(f"unknown router {name!r}; choose one of {', '.join(ROUTERS)}")
    return cls(**options)


__all__ = [
    "ROUTERS", "DloraRouter", "EngineRequest", "EngineState", "FirstFitRouter", "KernelCost", "Migration",
    "MostIdleRouter", "NoEngineError", "PerfProfile", "RandomRouter", "RankAwareRouter", "RequestInfo", "Router",
    "make_router", "pending_s",
]
