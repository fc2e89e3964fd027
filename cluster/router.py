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
from loraplex.cluster.placement import SPREAD_QUEUE, Placement, ReplicaView, Sent, rank_of
from loraplex.daemon.router import PerfProfile, RankAwareRouter, RequestInfo

MAX_SENT_PER_REPLICA = 4096
MAX_TRACKED = 100_000  # adapters' homes, and requests between their placement and their end


class LoraplexRequestRouter(RequestRouter):
    def initialize_state(self, kernel: str = "mbgmv", slo_ms: float = 36.0, miss_ms: float = 20.0,
                         host_miss_ms: float = 5.0, spread_queue: int = SPREAD_QUEUE,
                         profile: Mapping[str, Any] | None = None, **_: Any) -> None:
        policy = RankAwareRouter(PerfProfile.from_dict(profile) if profile else None, kernel=kernel,  # type: ignore[arg-type]
                                 slo_ms=slo_ms)
        self._placement = Placement(policy, miss_ms=miss_ms, host_miss_ms=host_miss_ms, spread_queue=spread_queue)
        # What was sent to each replica after its latest report: request id -> [sent at, what, ended].
        # An ended request no longer queues there, but its adapter counts as resident until the report.
        self._sent: dict[ReplicaID, dict[str, list]] = {}
        self._chosen: dict[str, tuple[ReplicaID, str | None]] = {}  # request id -> (replica, adapter)
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
        views = [ReplicaView(r.replica_id.unique_id, r.routing_stats or {}, *self._since_report(r),
                             r.replica_id == last, homes[r.replica_id]) for r in candidate_replicas]
        order = [candidate_replicas[i] for i in self._placement.order(request, views)]
        if payload is not None:
            work = request.prompt_len + request.max_tokens
            self._record(pending_request.metadata.internal_request_id, order[0].replica_id,
                         (adapter, request.rank, work))
        # Serve probes each rank's queue length with a deadline that doubles per rank tried (0.1 s
        # first): the placement's choice gets a second, longer probe before a busy host's slow
        # answer sends the request, and with it the adapter's home, elsewhere.
        return [[order[0]], [order[0]], *([r] for r in order[1:])]

    def _record(self, request_id: str, replica: ReplicaID, sent: Sent) -> None:
        """Count `sent` on `replica` now: Serve tells a router where a request went only at its end
        (on_request_routed comes only with strict max_ongoing_requests), and the placement's first
        choice is where it goes unless that replica's queue is full or its probe times out."""
        previous = self._chosen.pop(request_id, None)
        if previous is not None:  # chosen again (its first choice refused it): move it
            self._sent.get(previous[0], {}).pop(request_id, None)
        self._chosen[request_id] = (replica, sent[0])
        if len(self._chosen) > MAX_TRACKED:
            del self._chosen[next(iter(self._chosen))]
        per = self._sent.setdefault(replica, {})
        per[request_id] = [time.time(), sent, False]
        if len(per) > MAX_SENT_PER_REPLICA:
            del per[next(iter(per))]
        if sent[0]:
            self._home(sent[0], replica)

    def _home(self, adapter: str, replica: ReplicaID) -> None:
        self._last.pop(adapter, None)  # re-inserted: the dict stays in order of last use
        self._last[adapter] = replica
        if len(self._last) > MAX_TRACKED:
            del self._last[next(iter(self._last))]

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        """The request ended: it no longer queues where it was counted (until the replica's next report,
        its adapter counts as resident there), and its adapter's home follows it if it went elsewhere
        than the first choice. An ended request left counted as queued made a replica that served an
        adapter's requests one after another look queued deep, and the adapter spread (dLoRA) off an
        idle home before the first report came."""
        chosen = self._chosen.pop(internal_request_id, None)
        if chosen is None:
            return
        if chosen[0] != replica_id:
            self._sent.get(chosen[0], {}).pop(internal_request_id, None)
            if chosen[1] and self._last.get(chosen[1]) == chosen[0]:
                self._home(chosen[1], replica_id)
        elif (entry := self._sent.get(replica_id, {}).get(internal_request_id)) is not None:
            entry[2] = True

    def _since_report(self, replica: RunningReplica) -> tuple[list[Sent], frozenset[str]]:
        """What was sent to `replica` after its latest report (older sends are in the report): the
        requests still in flight, and the adapters of those that ended."""
        reported_at = float((replica.routing_stats or {}).get("at", 0.0))
        per = self._sent.get(replica.replica_id, {})
        for request_id in [r for r, (t, _, _) in per.items() if t <= reported_at]:
            del per[request_id]
        flying = [sent for _, sent, ended in per.values() if not ended]
        return flying, frozenset(sent[0] for _, sent, ended in per.values() if ended and sent[0])

    def _rank_of(self, adapter: str | None) -> int:
        return rank_of(adapter, [r.routing_stats or {} for r in self.curr_replicas.values()])


def _payload(pending: PendingRequest) -> dict[str, Any] | None:
    """The generate payload (wire.request) of a pending `generate` call; None for other calls."""
    if pending.args and isinstance(pending.args[0], dict) and "prompt" in pending.args[0]:
        return pending.args[0]
    return None
