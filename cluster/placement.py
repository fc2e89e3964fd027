"""Where a request should go among replicas, from their routing stats (stats.routing_stats):
the daemon's rank-aware policy (loraplex.daemon.router.RankAwareRouter) on an EngineState built
per replica, plus the cost of bringing the request's adapter there, with ties to the replica the
adapter was last sent to, and an adapter new to the cluster goes to the replica that is home to
the fewest adapters (as Serve's multiplexing does), so the working set spreads evenly.
Cross-replica balancing as dLoRA's proactive dispatch: once some
replica has `spread_queue` or more of the adapter's requests queued while another replica is
idle, affinity is off for that adapter and the policy alone places it, so a hot adapter spreads,
and the ingress moves requests still queued there (`should_move`, remote.QueueMover).
Pure: no Ray here, the request router (router.py) feeds it.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from loraplex.daemon.router import EngineRequest, EngineState, RankAwareRouter, RequestInfo

SPREAD_QUEUE = 4  # queued requests of one adapter on a replica past which it spreads (and queued ones move)
# (adapter, rank, work tokens) of a request routed to a replica after its latest report
Sent = tuple[str | None, int, int]


@dataclass(frozen=True, slots=True)
class ReplicaView:
    """One candidate replica: its latest routing stats and what was sent to it since."""

    key: str
    stats: Mapping[str, Any]
    sent: Sequence[Sent] = ()  # still in flight
    brought: frozenset[str] = frozenset()  # adapters of requests sent since that have ended (resident there)
    last_for_adapter: bool = False  # the request's adapter was last sent here
    assigned: int = 0  # adapters whose requests were last sent here (their home)

    def engine(self, index: int, default_tokens_per_s: float = 1000.0, default_step_ms: float = 0.0) -> EngineState:
        """The replica as the daemon's router sees an engine; the defaults stand in for a rate and a
        step time the replica has not measured yet."""
        def rows(key: str) -> tuple[EngineRequest, ...]:
            return tuple(EngineRequest(f"{key}{n}", a, int(r), int(t))
                         for n, (a, r, t) in enumerate(self.stats.get(key) or []))

        queued = tuple(EngineRequest(f"sent{n}", a, r, w) for n, (a, r, w) in enumerate(self.sent))
        s = self.stats
        return EngineState(engine_id=index, running=rows("running"), waiting=rows("waiting") + queued,
                           resident_adapters=frozenset(s.get("gpu") or ()) | self.brought
                           | {a for a, _, _ in self.sent if a},
                           max_num_seqs=int(s.get("max_num_seqs") or 1), healthy=bool(s.get("healthy", True)),
                           free_pages=int(s.get("free_pages") or 0), total_pages=int(s.get("total_pages") or 0),
                           tokens_per_s=float(s.get("tokens_per_s") or default_tokens_per_s),
                           step_ms=float(s.get("step_ms") or default_step_ms))

    def adapter_tier(self, adapter: str | None) -> str:
        """gpu (resident, or being brought there by a request sent since), host, or none."""
        if not adapter or adapter in (self.stats.get("gpu") or ()) or adapter in self.brought \
                or any(a == adapter for a, _, _ in self.sent):
            return "gpu"
        return "host" if adapter in (self.stats.get("host") or ()) else "none"


@dataclass(slots=True)
class Placement:
    """policy: the daemon's rank-aware router; miss_ms / host_miss_ms: what an adapter that is not
    on the replica's GPU costs, from its host tier or from disk / the adapter source."""

    policy: RankAwareRouter = field(default_factory=RankAwareRouter)
    miss_ms: float = 20.0
    host_miss_ms: float = 5.0
    spread_queue: int = SPREAD_QUEUE

    def __post_init__(self) -> None:
        if not (self.miss_ms >= 0 and self.host_miss_ms >= 0 and self.spread_queue >= 1):
            raise ValueError("miss_ms and host_miss_ms must be >= 0, spread_queue >= 1")

    def order(self, request: RequestInfo, replicas: Sequence[ReplicaView]) -> list[int]:
        """Indices into `replicas`, best first."""
        # A replica that has not run yet is as fast, and its steps as long, as those that have: with
        # an optimistic guess instead (no step time: the SLO never missed there), an idle replica
        # always looked better, and an adapter's requests left its home.
        rate = _mean_known(replicas, "tokens_per_s", 1000.0)
        step_ms = _mean_known(replicas, "step_ms", 0.0)
        engines = [r.engine(i, rate, step_ms) for i, r in enumerate(replicas)]
        affinity = not self.spreading(request.adapter, engines)

        def key(i: int) -> tuple[float, int, int, float, int, str]:
            replica, engine = replicas[i], engines[i]
            cost = self.policy.cost(request, engine) if engine.healthy else float("inf")
            if affinity:
                cost += self.adapter_ms(request.adapter, replica)
            return (cost, 0 if affinity and replica.last_for_adapter else 1, replica.assigned if affinity else 0,
                    self.policy.predicted_ms(request, engine), engine.num_requests, replica.key)

        return sorted(range(len(replicas)), key=key)

    def spreading(self, adapter: str | None, engines: Sequence[EngineState]) -> bool:
        """Whether `adapter` is queued deep on one replica while another is idle."""
        if not adapter:
            return False
        deepest = max((sum(r.adapter == adapter for r in e.waiting) for e in engines), default=0)
        return deepest >= self.spread_queue and any(e.healthy and e.num_requests == 0 for e in engines)

    def should_move(self, adapter: str | None, on: str, routing: Mapping[str, Mapping[str, Any]]) -> bool:
        """dLoRA's migration of queued requests: a request still waiting on replica `on` (no token
        yet) moves when `spread_queue` or more of its adapter's requests wait there (itself included)
        while another healthy replica has none at all. `routing`: replica -> its routing stats."""
        here = routing.get(on)
        if not adapter or here is None:
            return False
        queued = sum(1 for row in here.get("waiting") or () if row and row[0] == adapter)
        return queued >= self.spread_queue and any(
            key != on and stats.get("healthy", True) and not stats.get("running") and not stats.get("waiting")
            for key, stats in routing.items())

    def adapter_ms(self, adapter: str | None, replica: ReplicaView) -> float:
        tier = replica.adapter_tier(adapter)
        return 0.0 if tier == "gpu" else self.host_miss_ms if tier == "host" else self.miss_ms


def _mean_known(replicas: Sequence[ReplicaView], key: str, default: float) -> float:
    """The mean of the positive values of stats[key] (0 means not measured yet), else `default`."""
    known = [x for r in replicas if (x := float(r.stats.get(key) or 0.0)) > 0]
    return sum(known) / len(known) if known else default


def rank_of(adapter: str | None, stats: Sequence[Mapping[str, Any]]) -> int:
    """The adapter's LoRA rank as any replica reports it (0: base, or not known yet)."""
    if not adapter:
        return 0
    for s in stats:
        rank = (s.get("ranks") or {}).get(adapter)
        if isinstance(rank, int) and not isinstance(rank, bool):
            return rank
    return 0
