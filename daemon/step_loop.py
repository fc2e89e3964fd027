"""One engine's iteration loop: schedule a step, run it on the engine, apply what it produced.

Between two steps it carries out what was asked meanwhile (pause, a policy switch,
migrations, the router's rebalancing); around a step it handles the three ways one fails:
the engine ran out of memory (the batch shrinks), refused the step (after a few in a row it
counts as lost) or died (it is restarted and its requests recomputed). Torch-free.

There is one loop: it sends steps and collects their replies in order, keeping at most
`depth` steps out. With scheduler.overlap (and an engine that keeps a persistent batch) the
depth is 2: it plans and sends step n+1 while the engine runs step n, then collects n's
result (docs/architecture.md, "The step loop"); without, the depth is 1, nothing is planned
ahead and the loop is synchronous. What must see the engine idle (a pause, a policy switch,
migrations, an adapter order on the link, a CPU-assisted step) waits for the steps out first;
a failed step takes back every step out, whatever the depth.
"""
from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass

from loraplex.daemon.adapter_table import AdapterTable
from loraplex.daemon.child_link import EngineDied, EngineRefused
from loraplex.daemon.controls import Controls
from loraplex.daemon.decision_log import DecisionLog, StepDecision
from loraplex.daemon.engine_slot import EngineSlot
from loraplex.daemon.engine_supervisor import EngineSupervisor
from loraplex.daemon.request_table import RequestTable
from loraplex.daemon.scheduler.base import BaseScheduler
from loraplex.daemon.scheduler.sequence import Sequence
from loraplex.daemon.stats import ServingStats
from loraplex.ipc.engine_plan import StepPlan
from loraplex.ipc.errors import ErrorCode
from loraplex.ipc.protocol import EngineStepDone

log = logging.getLogger("loraplex.daemon")
MAX_STEP_FAILURES = 3  # refused steps in a row before the engine counts as lost
OVERLAP_DEPTH = 2  # steps out at most with overlap: the one the engine runs and the next


@dataclass(slots=True)
class _Sent:
    plan: StepPlan
    began: float  # planning started
    sent: float


class StepLoop:
    def __init__(self, slot: EngineSlot, engines: EngineSupervisor, requests: RequestTable, adapters: AdapterTable,
                 stats: ServingStats, controls: Controls, decisions: DecisionLog | None) -> None:
        self.slot = slot
        self.engines = engines
        self.requests = requests
        self.adapters = adapters
        self.stats = stats
        self.controls = controls
        self.decisions = decisions
        self.failures = 0  # refused steps in a row
        self.set_aside: list[Sequence] = []  # after an out-of-memory step; requeued after the next good one
        self.inflight: deque[_Sent] = deque()  # steps sent whose results are not applied
        self._returned = 0.0  # when the last result came back: the engine's next step began then
        self._takebacks = 0  # times the steps in flight were taken back (a failure, a lost engine)

    @property
    def depth(self) -> int:
        """Steps sent and not yet applied, at most: 2 with overlap on an engine that feeds its
        decode rows the tokens it sampled (a persistent batch), else 1 (synchronous)."""
        overlap = self.slot.config.scheduler.overlap and self.slot.plans is not None
        return OVERLAP_DEPTH if overlap else 1

    async def run(self) -> None:
        """Plan and send while fewer than `depth` steps are out, else (or when nothing more can be
        planned) collect and apply the oldest."""
        slot = self.slot
        slot.link.on_lost = slot.work.set  # an engine that dies or hangs while idle wakes this loop
        depth = self.depth
        while True:
            if not self.inflight:
                await slot.work.wait()
            if self.inflight and self._must_drain():
                await self._collect()
                continue
            if not await self._may_step():
                continue
            began = time.perf_counter()
            if not self.inflight:
                self._between_steps()
            sched = slot.scheduler
            plan = await self._schedule(sched) if len(self.inflight) < depth and self._may_plan_ahead() else None
            if plan is None:
                if self.inflight:
                    await self._collect()
                else:
                    self._rest()
                continue
            takebacks = self._takebacks
            plan = await self._prepare(sched, plan)
            while plan.cpu is not None and self.inflight:  # CPU workers take one step at a time
                await self._collect()
            if takebacks != self._takebacks:  # planned on steps that failed meanwhile: planned again
                continue
            try:
                await slot.link.submit(slot.step_order(plan))
            except EngineDied as exc:
                sched.discard_inflight()
                await self._lose(str(exc))
                continue
            sched.launch(plan)
            self.inflight.append(_Sent(plan, began, time.perf_counter()))

    def _must_drain(self) -> bool:
        """What needs the engine idle, or a scheduler between steps, is waiting."""
        slot = self.slot
        return (self.controls.paused or slot.policy_switch is not None or bool(slot.moves)
                or slot.link.callers > 0 or self.engines.replicas.due_for_rebalance())

    def _may_plan_ahead(self) -> bool:
        """Nothing in flight needs the engine alone: a CPU-assisted step runs with none ahead."""
        return not any(sent.plan.cpu is not None for sent in self.inflight)

    async def _collect(self) -> None:
        """Wait for the oldest step in flight and apply it; a failure takes back every step in flight."""
        sched, sent = self.slot.scheduler, self.inflight[0]
        try:
            reply = await self.slot.link.collect()
        except EngineRefused as exc:
            if await self._abandon_inflight():
                await self._refused(sent.plan, exc)
            return
        except EngineDied as exc:
            await self._lose(str(exc))
            return
        if not isinstance(reply, EngineStepDone):  # not a step's reply: what is in flight is unknown
            log.error("engine %d answered a step with %s", self.slot.index, reply.TYPE)
            await self._abandon_inflight()
            return
        self.inflight.popleft()
        self.failures = 0
        # The engine began this step when it was sent or when the step before came back; the
        # daemon's own time is its planning (the wait for the step before is not).
        started, self._returned = max(sent.sent, self._returned), time.perf_counter()
        await self._apply(sched, sent.plan, reply, started - (sent.sent - sent.began), started)
        self._requeue_set_aside()

    async def _abandon_inflight(self) -> bool:
        """A step failed: the steps after it were planned on its tokens, so their replies are
        awaited and dropped, and every step in flight is planned again after a resync. False
        when the engine was lost meanwhile (that was dealt with)."""
        link = self.slot.link
        while link.outstanding:
            try:
                await link.collect()
            except EngineRefused:
                continue
            except EngineDied as exc:
                await self._lose(str(exc))
                return False
        self.inflight.clear()
        self._takebacks += 1
        self.slot.scheduler.discard_inflight()
        self.slot.resync()
        return True

    async def _lose(self, reason: str) -> None:
        """The engine is gone: take back what was in flight (the tokens streamed so far stay the
        recompute's starting point), then restart it."""
        self.inflight.clear()
        self._takebacks += 1
        if self.slot.scheduler is not None:
            self.slot.scheduler.discard_inflight()
        await self.engines.engine_lost(self.slot, reason)

    async def _may_step(self) -> bool:
        """False when the engine was lost (it is restarted first) or scheduling is paused."""
        slot = self.slot
        if not slot.link.alive():
            await self._lose(getattr(slot.link, "lost_reason", None) or "the engine exited")
            return False
        if self.controls.paused:
            slot.work.clear()  # resuming wakes us
            return False
        return True

    def _between_steps(self) -> None:
        """What was asked since the last step: a policy switch, migrations, the router's rebalancing."""
        slot = self.slot
        if slot.policy_switch is not None:
            slot.apply_policy_switch(self.controls.cache_policy, self.adapters)
        if slot.moves:
            self.engines.carry_out_moves(slot)
        if self.engines.replicas.due_for_rebalance():
            self.engines.rebalance()

    async def _schedule(self, sched: BaseScheduler | None) -> StepPlan | None:
        if sched is None:
            return None
        plan = sched.schedule()
        for aborted in sched.take_aborted():  # SLO early abort
            await self.requests.fail(aborted.request_id, ErrorCode(aborted.code), aborted.message)
        return plan

    def _rest(self) -> None:
        """Nothing to run: what an out-of-memory step set aside goes now, else sleep until work comes."""
        if self.set_aside:
            self._requeue_set_aside()
        else:
            self.slot.work.clear()

    async def _prepare(self, sched: BaseScheduler, plan: StepPlan) -> StepPlan:
        """Give cold adapters' prefill rows CPU layers (cpu_assist); record the step."""
        cpu = self.engines.cpu
        if cpu is not None and plan.merged_adapter is None:
            try:
                plan = await cpu.prepare(plan, self.adapters)
            except Exception:  # never stall the loop: the engine computes every row's LoRA itself
                log.exception("engine %d: CPU-assisted prefill could not be planned; step %d runs without it",
                              self.slot.index, plan.step_id)
        self.requests.note_scheduled(plan, sched.waited_for_adapter)
        self.stats.placed(len(plan.place), len(plan.evict))
        if self.decisions is not None:
            client_id = self.requests.client_id
            self.decisions.write(StepDecision(
                self.slot.index, plan.step_id, tuple(client_id(r.request_id) for r in plan.rows if r.start_pos == 0),
                tuple(client_id(r.request_id) for r in plan.rows), plan.merged_adapter))
        return plan

    async def _refused(self, plan: StepPlan, exc: EngineRefused) -> None:
        if exc.code == ErrorCode.OVERLOADED.value and plan.rows:  # out of memory; the engine is fine
            self.set_aside += await self._shrink_after_oom(plan, str(exc))
            return
        self.failures += 1
        log.error("engine %d step failed (%d in a row): %s", self.slot.index, self.failures, exc)
        if self.failures >= MAX_STEP_FAILURES:
            await self.engines.engine_lost(self.slot, f"engine failed {self.failures} steps in a row: {exc}")
            self.failures = 0

    async def _shrink_after_oom(self, plan: StepPlan, reason: str) -> list[Sequence]:
        """The engine ran out of memory on `plan` (and discarded it): retry with half its requests,
        setting the rest aside (returned; recomputed later from prompt + tokens so far). A request
        that runs out of memory alone fails with `overloaded`; so every failure shrinks the batch."""
        slot = self.slot
        ids = list(dict.fromkeys(row.request_id for row in plan.rows))
        held = [seq for rid in ids[(len(ids) + 1) // 2:] if (seq := slot.scheduler.detach(rid)) is not None]
        if not held:
            log.error("engine %d ran out of memory on request %s alone: %s", slot.index, ids[0], reason)
            await self.requests.fail(ids[0], ErrorCode.OVERLOADED,
                                     f"the engine ran out of memory running this request alone ({reason})")
            return []
        log.warning("engine %d ran out of memory on a step of %d requests; retrying with %d (%s)", slot.index,
                    len(ids), len(ids) - len(held), reason)
        return held

    def _requeue_set_aside(self) -> None:
        set_aside, self.set_aside = self.set_aside, []
        for seq in set_aside:
            if seq.request_id in self.requests:  # not cancelled or failed meanwhile
                self.slot.adopt_sequence(seq)

    async def _apply(self, sched: BaseScheduler, plan: StepPlan, reply: EngineStepDone, began: float,
                     sent: float) -> None:
        """Stream the step's tokens, finish what finished, and account for its time."""
        returned = time.perf_counter()
        finished = {seq.request_id: seq.finish_reason for seq in sched.apply(plan, reply.result)}
        await self.requests.deliver(reply.result, finished)
        lora_ranks = [self.adapters.rank_of(r.adapter) for r in plan.rows
                      if r.adapter is not None and r.adapter != plan.merged_adapter]
        self.slot.observe_step(plan.num_tokens, returned - sent, lora_ranks, plan.prefill_tokens)
        self.stats.step(plan, reply.result, (returned - sent) * 1e3,
                        (sent - began) * 1e3 + (time.perf_counter() - returned) * 1e3)
        if self.engines.cpu is not None:
            self.engines.cpu.observe(plan, reply.result)
