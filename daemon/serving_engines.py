"""The serving core's engine-side events: requests moving between engines
(router co-migration, an explicit move), an engine that died or hung (its
requests re-placed and recomputed, the engine restarted with backoff), and an
engine that ran out of memory on a step (the batch shrinks).

Torch-free; mixed into ServingCore (daemon/serving.py), whose request records
and failure paths it uses. A moved or recomputed request continues from its
prompt and the tokens already streamed: no gap, no duplicate.
"""
from __future__ import annotations

import asyncio
import logging

from loraplex.daemon.child_link import EngineDied, EngineRefused
from loraplex.daemon.engine_slot import EngineSlot
from loraplex.daemon.scheduler.sequence import Sequence
from loraplex.daemon.serving_adapters import Rejected
from loraplex.ipc.engine_plan import StepPlan
from loraplex.ipc.errors import ErrorCode

log = logging.getLogger("loraplex.daemon")
MAX_ENGINE_RETRIES = 2


class EngineEvents:
    """Needs from its host class: slots, replicas, requests, adapters, stats, _fail, _engine_up."""

    def migrate(self, key: str, target: int) -> None:
        """Move request `key` (queued or running) to engine `target` between two of its engine's
        steps; a running one continues there by recompute from its prompt and streamed tokens."""
        state = self.requests.get(key)
        if state is None or not 0 <= target < len(self.slots):
            raise Rejected(ErrorCode.NOT_FOUND, f"no request {key!r} in flight, or no engine {target}")
        source = self.slots[state.engine]
        source.moves.append((key, target))
        source.work.set()

    def _carry_out_moves(self, slot: EngineSlot) -> None:
        moves, slot.moves = slot.moves, []
        for key, target in moves:
            if self.replicas.migrate(key, slot.index, target) is not None and key in self.requests:
                self.requests[key].engine = target
                self.requests[key].migrations += 1

    def _rebalance(self) -> None:
        """Carry out the router's request-adapter co-migrations (dlora); each moved request is
        recomputed on its new engine from its prompt and the tokens already streamed."""
        for migration, seqs in self.replicas.rebalance(self.adapters):
            for seq in seqs:
                state = self.requests.get(seq.request_id)
                if state is not None:
                    state.engine = migration.target
                    state.migrations += 1

    async def _shrink_after_oom(self, slot: EngineSlot, plan: StepPlan, reason: str) -> list[Sequence]:
        """The engine ran out of memory on `plan` (and discarded it): retry with half its requests,
        setting the rest aside (returned; recomputed later from prompt + tokens so far). A request
        that runs out of memory alone fails with `overloaded`; so every failure shrinks the batch."""
        ids = list(dict.fromkeys(row.request_id for row in plan.rows))
        held = [seq for rid in ids[(len(ids) + 1) // 2:] if (seq := slot.scheduler.detach(rid)) is not None]
        if not held:
            log.error("engine %d ran out of memory on request %s alone: %s", slot.index, ids[0], reason)
            await self._fail(ids[0], ErrorCode.OVERLOADED,
                             f"the engine ran out of memory running this request alone ({reason})")
            return []
        log.warning("engine %d ran out of memory on a step of %d requests; retrying with %d (%s)", slot.index,
                    len(ids), len(ids) - len(held), reason)
        return held

    def _requeue_held(self, slot: EngineSlot, held: list[Sequence]) -> None:
        for seq in held:
            if seq.request_id in self.requests:  # not cancelled or failed meanwhile
                slot.adopt_sequence(seq)

    async def _engine_lost(self, slot: EngineSlot, reason: str) -> None:
        """Restart a dead engine. Its requests go to another healthy engine at once, or wait for
        this one; either way they are recomputed from their prompt and the tokens already
        streamed (up to MAX_ENGINE_RETRIES times each), so nothing is lost or repeated."""
        log.error("engine %d lost: %s", slot.index, reason)
        self.stats.engine_restarts += 1
        seqs, pending = slot.take_all()
        for seq in seqs:
            state = self.requests.get(seq.request_id)
            if state is None:
                continue
            state.engine_retries += 1
            if state.engine_retries > MAX_ENGINE_RETRIES:
                await self._fail(seq.request_id, ErrorCode.ENGINE_FAILED,
                                 f"the engine failed {state.engine_retries} times while running this request "
                                 f"({reason})")
                continue
            target = self.replicas.choose(seq, self.adapters, exclude=slot.index)
            state.engine = target.index
            target.adopt_sequence(seq)
            self.replicas.rerouted += target is not slot
        for req in pending:
            target = self.replicas.choose(req, self.adapters, exclude=slot.index)
            if req.request_id in self.requests:
                self.requests[req.request_id].engine = target.index
            target.enqueue(req)
            self.replicas.rerouted += target is not slot
        delay = 0.5
        while True:
            try:
                await self._engine_up(slot)
                log.info("engine %d restarted", slot.index)
                return
            except (EngineDied, EngineRefused, OSError) as exc:
                log.error("engine %d restart failed: %s; retrying in %.1f s", slot.index, exc, delay)
                waiting = [s.request_id for s in slot.carried] + [r.request_id for r in slot.pending]
                slot.carried, slot.pending = [], []
                for key in waiting:
                    await self._fail(key, ErrorCode.UNAVAILABLE, f"the engine could not be restarted: {exc}")
                await asyncio.sleep(delay)
                delay = min(delay * 2, 30.0)

