"""Engine replicas behind one router: place each new request on an engine,
re-place the requests of a dead engine, and carry out the router's
request-adapter co-migrations between steps.

Torch-free. The router only sees EngineState snapshots built from the slots'
schedulers; this module turns its decisions into queue moves.
"""
from __future__ import annotations

import logging
import time
from dataclasses import replace

from loraplex.daemon.adapter_table import AdapterTable
from loraplex.daemon.config import SchedulerSettings
from loraplex.daemon.engine_slot import EngineSlot
from loraplex.daemon.router import NoEngineError, PerfProfile, RequestInfo, Router, make_router
from loraplex.daemon.router.state import Migration
from loraplex.daemon.scheduler.sequence import SeqRequest, Sequence

log = logging.getLogger("loraplex.daemon")


def build_router(name: str, settings: SchedulerSettings) -> Router:
    """The router `name` with its options from the scheduler settings."""
    if name == "rank_aware":
        profile = PerfProfile.load(settings.router_profile) if settings.router_profile else None
        return make_router(name, profile=profile, kernel=settings.router_kernel, slo_ms=settings.tpt_slo_ms)
    return make_router(name)


class Replicas:
    def __init__(self, slots: list[EngineSlot], router: Router, rebalance_interval_s: float) -> None:
        if not slots:
            raise ValueError("at least one engine is needed")
        self.slots = slots
        self.router = router
        self.rebalance_interval_s = rebalance_interval_s
        self._last_rebalance = 0.0
        self.migrated = 0  # requests moved by co-migration
        self.rerouted = 0  # requests of a dead engine placed on another one

    def __len__(self) -> int:
        return len(self.slots)

    def healthy(self) -> list[EngineSlot]:
        return [s for s in self.slots if s.healthy]

    def info(self, seq: SeqRequest | Sequence, adapters: AdapterTable) -> RequestInfo:
        req = seq.req if isinstance(seq, Sequence) else seq
        entry = adapters.get(req.adapter) if req.adapter is not None else None
        done = len(seq.output_ids) if isinstance(seq, Sequence) else 0
        return RequestInfo(request_id=req.request_id, adapter=req.adapter, rank=entry.rank if entry else 0,
                           prompt_len=len(req.prompt_ids) + done, max_tokens=max(1, req.max_tokens - done),
                           adapter_bytes=entry.nbytes if entry else 0)

    def choose(self, seq: SeqRequest | Sequence, adapters: AdapterTable, exclude: int | None = None) -> EngineSlot:
        """The slot that should serve `seq`. With one engine, or none healthy, the first
        (requests then wait for it to come up); `exclude`: an engine that just died."""
        if len(self.slots) == 1:
            return self.slots[0]
        states = [s.state(adapters) for s in self.slots]
        if exclude is not None:
            states[exclude] = replace(states[exclude], healthy=False)
        try:
            return self.slots[self.router.choose(self.info(seq, adapters), states)]
        except NoEngineError:  # none is up: wait for the first one that is not the one just lost
            return next(s for s in self.slots if s.index != exclude)

    def due_for_rebalance(self) -> bool:
        return len(self.slots) > 1 and time.monotonic() - self._last_rebalance >= self.rebalance_interval_s

    def rebalance(self, adapters: AdapterTable) -> list[tuple[Migration, list[Sequence]]]:
        """Ask the router for migrations and move the requests that can move now (not in a plan in
        flight). Returns what moved, so the caller can update its request records."""
        self._last_rebalance = time.monotonic()
        states = [s.state(adapters) for s in self.slots]
        moved: list[tuple[Migration, list[Sequence]]] = []
        for migration in self.router.rebalance(states):
            source, target = self.slots[migration.source], self.slots[migration.target]
            if not (source.healthy and target.healthy):
                continue
            seqs = [seq for rid in migration.request_ids if (seq := source.scheduler.detach(rid)) is not None]
            for seq in seqs:
                target.adopt_sequence(seq)
            if seqs:
                self.migrated += len(seqs)
                moved.append((migration, seqs))
                log.info("migrated %d requests of adapter %s from engine %d to engine %d%s", len(seqs),
                         migration.adapter or "base", source.index, target.index,
                         " (adapter loads there)" if migration.load_adapter else "")
        return moved

    def migrate(self, request_id: str, source: int, target: int) -> Sequence | None:
        """Move one request (queued or running) between engines: a running one continues on the
        target by recompute from its prompt and the tokens already streamed."""
        src, dst = self.slots[source], self.slots[target]
        if source == target or not (src.healthy and dst.healthy):
            return None
        seq = src.scheduler.detach(request_id)
        if seq is not None:
            dst.adopt_sequence(seq)
            self.migrated += 1
        return seq

