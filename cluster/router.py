"""The loraplex request router for Ray Serve: each request goes to the replica where the
daemon's rank-aware policy (loraplex.daemon.router.RankAwareRouter, Toppings' Algorithm 1: the
decode-step latency the request adds to that replica's batch of LoRA ranks, plus a penalty
for every request it would push past the TPT SLO) plus the cost of bringing its adapter there
(none when resident on the replica's GPU, `host_miss_ms` from its host tier, `miss_ms` from
disk or the adapter source) is lowest; ties go to the replica that served the adapter last.

It reads each replica's routing stats (replica.py: running and waiting requests with their
ranks and remaining tokens, resident adapters per tier, step time), adds what it routed since
the replica's latest report, builds the daemon's EngineState from them and asks the same policy
object the daemon and the simulator use. Torch-free.
"""
from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from loraplex.cluster import wire
from loraplex.daemon.router import EngineRequest, EngineState, PerfProfile, RankAwareRouter, RequestInfo

MAX_SENT_PER_REPLICA = 4096


class LoraplexRequestRouter(RequestRouter):
    def initialize_state(self, kernel: str = "mbgmv", slo_ms: float = 36.0, miss_ms: float = 20.0,
                         host_miss_ms: float = 5.0, profile: Mapping[str, Any] | None = None, **_: Any) -> None:
        if not (miss_ms >= 0 and host_miss_ms >= 0):
            raise ValueError("miss_ms and host_miss_ms must be >= 0")
        self._policy = RankAwareRouter(PerfProfile.from_dict(profile) if profile else None, kernel=kernel,
                                       slo_ms=slo_ms)  # type: ignore[arg-type]
        self._miss_ms = miss_ms
        self._host_miss_ms = host_miss_ms
        # (sent at, adapter, rank, work tokens) routed to a replica after its latest stats report
        self._sent: dict[ReplicaID, list[tuple[float, str | None, int, int]]] = {}
        self._last: dict[str, ReplicaID] = {}  # the replica each adapter was last routed to

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if pending_request is None or len(candidate_replicas) <= 1:
            return [candidate_replicas]
        request = self._request_info(pending_request, candidate_replicas)
        engines = [self._engine(i, r) for i, r in enumerate(candidate_replicas)]
        last = self._last.get(request.adapter) if request.adapter else None

        def key(i: int) -> tuple[float, int, float, int, str]:
            replica, engine = candidate_replicas[i], engines[i]
            cost = self._policy.cost(request, engine) if engine.healthy else float("inf")
            return (cost + self._adapter_ms(request.adapter, replica), 0 if replica.replica_id == last else 1,
                    self._policy.predicted_ms(request, engine), engine.num_requests, replica.replica_id.unique_id)

        order = sorted(range(len(candidate_replicas)), key=key)
        return [[candidate_replicas[i]] for i in order]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        payload = _payload(pending_request)
        adapter = payload.get("adapter") if payload else None
        rank = self._rank_of(adapter)
        work = wire.prompt_len(payload) + int((payload.get("options") or {}).get("max_tokens") or 0) if payload else 0
        sent = self._sent.setdefault(replica_id, [])
        sent.append((time.time(), adapter, rank, work))
        del sent[:-MAX_SENT_PER_REPLICA]
        if adapter:
            self._last[adapter] = replica_id

    # ---- the policy's view -----------------------------------------------------------------------
    def _rank_of(self, adapter: str | None) -> int:
        if not adapter:
            return 0
        for replica in self.curr_replicas.values():
            rank = (replica.routing_stats or {}).get("ranks", {}).get(adapter)
            if isinstance(rank, int):
                return rank
        return 0

    def _request_info(self, pending: PendingRequest, replicas: list[RunningReplica]) -> RequestInfo:
        payload = _payload(pending)
        adapter = (payload.get("adapter") if payload else None) or pending.metadata.multiplexed_model_id or None
        options = (payload.get("options") or {}) if payload else {}
        return RequestInfo(request_id=pending.metadata.request_id, adapter=adapter, rank=self._rank_of(adapter),
                           prompt_len=wire.prompt_len(payload) if payload else 0,
                           max_tokens=int(options.get("max_tokens") or 0))

    def _engine(self, index: int, replica: RunningReplica) -> EngineState:
        stats = replica.routing_stats or {}
        reported_at = float(stats.get("at", 0.0))
        sent = [s for s in self._sent.get(replica.replica_id, []) if s[0] > reported_at]
        self._sent[replica.replica_id] = sent

        def rows(key: str) -> tuple[EngineRequest, ...]:
            return tuple(EngineRequest(f"{key}{n}", a, int(r), int(t))
                         for n, (a, r, t) in enumerate(stats.get(key) or []))

        queued = tuple(EngineRequest(f"sent{n}", a, r, w) for n, (_, a, r, w) in enumerate(sent))
        return EngineState(engine_id=index, running=rows("running"), waiting=rows("waiting") + queued,
                           resident_adapters=frozenset(stats.get("gpu") or ()) | {a for _, a, _, _ in sent if a},
                           max_num_seqs=int(stats.get("max_num_seqs") or 1), healthy=bool(stats.get("healthy", True)),
                           free_pages=int(stats.get("free_pages") or 0), total_pages=int(stats.get("total_pages") or 0),
                           tokens_per_s=float(stats.get("tokens_per_s") or 1000.0),
                           step_ms=float(stats.get("step_ms") or 0.0))

    def _adapter_ms(self, adapter: str | None, replica: RunningReplica) -> float:
        if not adapter:
            return 0.0
        stats = replica.routing_stats or {}
        if adapter in (stats.get("gpu") or ()) or any(a == adapter for _, a, _, _ in self._sent.get(replica.replica_id, [])):
            return 0.0
        return self._host_miss_ms if adapter in (stats.get("host") or ()) else self._miss_ms


def _payload(pending: PendingRequest) -> dict[str, Any] | None:
    """The generate payload (wire.request) of a pending `generate` call; None for other calls."""
    if pending.args and isinstance(pending.args[0], dict) and "prompt" in pending.args[0]:
        return pending.args[0]
    return None
