"""The loraplex request router for Ray Serve (RequestRouterConfig.request_router_class =
"loraplex.cluster.router:LoraplexRequestRouter"): each request goes to the replica placement.py
ranks first, the daemon's rank-aware policy plus adapter affinity, from each replica's routing
stats and the requests this router sent it since its latest report. Torch-free.

request_router_kwargs: kernel (mbgmv|bgmv), slo_ms, miss_ms, host_miss_ms, spread_queue,
profile (a PerfProfile dict: {"mbgmv": {"alpha": .., "beta": ..}}).
"""
from __future__ import annotations

import time
from collections import Counter
from collections.abc import Mapping
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from loraplex.cluster import wire
from loraplex.cluster.placement import Placement, ReplicaView, Sent, rank_of
from loraplex.daemon.router import PerfProfile, RankAwareRouter, RequestInfo

MAX_SENT_PER_REPLICA = 4096
MAX_ADAPTERS_TRACKED = 100_000


class LoraplexRequestRouter(RequestRouter):
    def initialize_state(self, kernel: str = "mbgmv", slo_ms: float = 36.0, miss_ms: float = 20.0,
                         host_miss_ms: float = 5.0, spread_queue: int = 4, profile: Mapping[str, Any] | None = None,
                         **_: Any) -> None:
        policy = RankAwareRouter(PerfProfile.from_dict(profile) if profile else None, kernel=kernel,  # type: ignore[arg-type]
                                 slo_ms=slo_ms)
        self._placement = Placement(policy, miss_ms=miss_ms, host_miss_ms=host_miss_ms, spread_queue=spread_queue)
        self._sent: dict[ReplicaID, list[tuple[float, Sent]]] = {}  # (sent at, what) per replica
        self._last: dict[str, ReplicaID] = {}  # the replica each adapter was last routed to (its home)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if pending_request is None or len(candidate_replicas) <= 1:
            return [candidate_replicas]
        payload = _payload(pending_request)
        adapter = (payload or {}).get("adapter") or pending_request.metadata.multiplexed_model_id or None
        options = (payload or {}).get("options") or {}
        request = RequestInfo(request_id=pending_request.metadata.request_id, adapter=adapter,
                              rank=self._rank_of(adapter), prompt_len=wire.prompt_len(payload or {}),
                              max_tokens=int(options.get("max_tokens") or 0))
        last = self._last.get(adapter) if adapter else None
        homes = Counter(self._last.values())
        views = [ReplicaView(r.replica_id.unique_id, r.routing_stats or {}, self._pending(r),
                             r.replica_id == last, homes[r.replica_id]) for r in candidate_replicas]
        return [[candidate_replicas[i]] for i in self._placement.order(request, views)]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        payload = _payload(pending_request)
        if payload is None:
            return
        adapter = payload.get("adapter")
        work = wire.prompt_len(payload) + int((payload.get("options") or {}).get("max_tokens") or 0)
        sent = self._sent.setdefault(replica_id, [])
        sent.append((time.time(), (adapter, self._rank_of(adapter), work)))
        del sent[:-MAX_SENT_PER_REPLICA]
        if adapter:
            self._last.pop(adapter, None)  # re-inserted: the dict stays in order of last use
            self._last[adapter] = replica_id
            if len(self._last) > MAX_ADAPTERS_TRACKED:
                del self._last[next(iter(self._last))]

    def _pending(self, replica: RunningReplica) -> list[Sent]:
        """What was sent to `replica` after its latest report (older sends are in the report)."""
        reported_at = float((replica.routing_stats or {}).get("at", 0.0))
        kept = [(t, s) for t, s in self._sent.get(replica.replica_id, []) if t > reported_at]
        self._sent[replica.replica_id] = kept
        return [s for _, s in kept]

    def _rank_of(self, adapter: str | None) -> int:
        return rank_of(adapter, [r.routing_stats or {} for r in self.curr_replicas.values()])


def _payload(pending: PendingRequest) -> dict[str, Any] | None:
    """The generate payload (wire.request) of a pending `generate` call; None for other calls."""
    if pending.args and isinstance(pending.args[0], dict) and "prompt" in pending.args[0]:
        return pending.args[0]
    return None
