"""dLoRA routing (dLoRA §5), torch-free: proactive dispatch and reactive
request-adapter co-migration.

Proactive: a new request goes to the engine where it would finish its own work
soonest: the engine's pending time (outstanding tokens over its measured rate,
plus loading the adapters its queue still waits for) plus the request's work
plus loading its adapter there when it is not resident.
Reactive: when the most loaded engine's pending time exceeds the least loaded
one's by more than `imbalance` of the mean (and `min_gap_s`), queued requests
move from the first to the second one adapter group at a time, together with
their adapter when the target lacks it. Each move takes the group (or the
oldest part of it) that leaves the pair most even, and is only made when it
shrinks the gap; the loop stops at `max_migrations`. Running requests stay
where their KV cache is.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar
from typing import Sequence as Seq

from loraplex.daemon.router.base import Router, healthy
from loraplex.daemon.router.state import EngineRequest, EngineState, Migration, RequestInfo


def pending_s(engine: EngineState) -> float:
    """Seconds until `engine` has worked off everything it holds, adapter loads included."""
    rate = max(engine.tokens_per_s, 1e-9)
    loads: dict[str, float] = {}
    for r in engine.waiting:
        if r.adapter is not None and r.adapter not in loads:
            loads[r.adapter] = engine.load_s(r.adapter, r.adapter_bytes)
    return engine.pending_tokens / rate + sum(loads.values())


@dataclass(slots=True)
class _Sim:
    """An engine's load while migrations are being planned."""

    load_s: float
    rate: float
    resident: set[str]  # resident, queued for loading, or brought in by a planned migration
    waiting: list[EngineRequest] = field(default_factory=list)


class DloraRouter(Router):
    name: ClassVar[str] = "dlora"

    def __init__(self, *, imbalance: float = 0.25, min_gap_s: float = 0.05, max_migrations: int = 8) -> None:
        if imbalance < 0 or min_gap_s < 0 or max_migrations < 0:
            raise ValueError("imbalance, min_gap_s and max_migrations must be non-negative")
        self.imbalance = imbalance
        self.min_gap_s = min_gap_s
        self.max_migrations = max_migrations

    def finish_s(self, request: RequestInfo, engine: EngineState) -> float:
        """Predicted time until `request` is done if sent to `engine`."""
        own = request.work_tokens / max(engine.tokens_per_s, 1e-9)
        queued_load = any(r.adapter == request.adapter for r in engine.waiting)
        load = 0.0 if queued_load else engine.load_s(request.adapter, request.adapter_bytes)
        return pending_s(engine) + own + load

    def choose(self, request: RequestInfo, engines: Seq[EngineState]) -> int:
        return min(healthy(engines), key=lambda i: (self.finish_s(request, engines[i]), engines[i].num_requests, i))

    def rebalance(self, engines: Seq[EngineState]) -> list[Migration]:
        live = [i for i, e in enumerate(engines) if e.healthy]
        if len(live) < 2:
            return []
        sims = {i: _Sim(load_s=pending_s(engines[i]), rate=max(engines[i].tokens_per_s, 1e-9),
                        resident=set(engines[i].resident_adapters) | {r.adapter for r in engines[i].waiting
                                                                       if r.adapter is not None},
                        waiting=list(engines[i].waiting)) for i in live}
        moves: list[Migration] = []
        while len(moves) < self.max_migrations:
            src = max(live, key=lambda i: (sims[i].load_s, -i))
            dst = min(live, key=lambda i: (sims[i].load_s, i))
            gap = sims[src].load_s - sims[dst].load_s
            mean = sum(s.load_s for s in sims.values()) / len(sims)
            if src == dst or gap <= max(self.min_gap_s, self.imbalance * mean):
                break
            move = self._best_move(engines[dst], sims[src], sims[dst], gap)
            if move is None:
                break
            adapter, reqs, new_src, new_dst = move
            load = adapter is not None and adapter not in engines[dst].resident_adapters
            moves.append(Migration(request_ids=tuple(r.request_id for r in reqs), adapter=adapter, source=src,
                                   target=dst, load_adapter=load, moved_tokens=sum(r.remaining_tokens for r in reqs)))
            sims[src].load_s, sims[dst].load_s = new_src, new_dst
            moved = {r.request_id for r in reqs}
            sims[src].waiting = [r for r in sims[src].waiting if r.request_id not in moved]  # each moves once
            if adapter is not None:
                sims[dst].resident.add(adapter)
        return moves

    def _best_move(self, target: EngineState, src: _Sim, dst: _Sim, gap: float):
        """(adapter, requests, new source load, new target load) of the move that leaves the
        pair most even, or None when no move shrinks the gap without making the target the
        new bottleneck (its load must stay below the source's current one)."""
        groups: dict[str | None, list[EngineRequest]] = {}
        for r in src.waiting:
            groups.setdefault(r.adapter, []).append(r)
        best = None
        best_gap = gap
        for adapter, reqs in groups.items():
            load = 0.0
            if adapter is not None and adapter not in dst.resident:
                load = target.load_s(adapter, max(r.adapter_bytes for r in reqs))
            taken: list[EngineRequest] = []
            tokens = 0
            for r in reqs:  # the oldest part of the group, as long as the pair keeps getting more even
                tokens_next = tokens + r.remaining_tokens
                new_src = src.load_s - tokens_next / src.rate
                new_dst = dst.load_s + tokens_next / dst.rate + load
                new_gap = abs(new_src - new_dst)
                if new_gap >= best_gap or new_dst >= src.load_s:
                    if new_src < new_dst:
                        break
                    taken.append(r)
                    tokens = tokens_next
                    continue
                taken.append(r)
                tokens = tokens_next
                best_gap = new_gap
                best = (adapter, list(taken), new_src, new_dst)
        return best
