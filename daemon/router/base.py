"""The router contract (torch-free): pick an engine for a new request, and
optionally propose migrations between engines. Pure functions of the snapshots
given; the daemon carries the decisions out.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar
from typing import Sequence as Seq

from loraplex.daemon.router.state import EngineState, Migration, RequestInfo


class NoEngineError(RuntimeError):
    """No healthy engine can take the request."""


class Router(ABC):
    name: ClassVar[str] = "base"

    @abstractmethod
    def choose(self, request: RequestInfo, engines: Seq[EngineState]) -> int:
        """Index into `engines` of the engine that should serve `request`; raises NoEngineError
        when none is healthy."""

    def rebalance(self, engines: Seq[EngineState]) -> list[Migration]:
        """Migrations that even out the load; none unless the policy migrates."""
        return []


def healthy(engines: Seq[EngineState]) -> list[int]:
    """Indices of the healthy engines; NoEngineError if there are none."""
    found = [i for i, e in enumerate(engines) if e.healthy]
    if not found:
        raise NoEngineError(f"none of the {len(engines)} engines is healthy")
    return found
