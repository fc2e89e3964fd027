"""The iteration-level scheduler every policy shares (torch-free).

Owns a request's way through one engine: queued, admitted, preempted (recompute-style, when KV
runs out), its step results folded in, finished, aborted early or handed over. The concerns are
collaborators it owns: roster.py (queue and batch), plan_draft.py (the plan being built),
admit_gate.py (who may enter), clustering.py, kv_pages.py, prefix_reuse.py, lookahead.py (steps
in flight) and outputs.py (stop rules). A policy only decides, once per iteration, which
sequences get how many tokens: it implements `_plan` with the helpers `_run` (a running
sequence) and `_admit` (a queued one). Nothing here imports torch or blocks.
"""
from __future__ import annotations

import itertools
import math
import time
from abc import ABC, abstractmethod
from collections import deque
from typing import Callable, ClassVar
from typing import Sequence as Seq

from loraplex.contracts.geometry import PageGeometry
from loraplex.daemon.gpu_cache.predictor import ArrivalPredictor
from loraplex.daemon.memory.adapter_residency import AdapterResidency
from loraplex.daemon.memory.allocator import PageAllocator
from loraplex.daemon.memory.prefix_cache import PrefixCache
from loraplex.daemon.scheduler.admission import EarlyAbort, SloAdmission
from loraplex.daemon.scheduler.admit_gate import AdmitGate
from loraplex.daemon.scheduler.clustering import AdapterClustering
from loraplex.daemon.scheduler.config import SchedulerConfig
from loraplex.daemon.scheduler.estimators import OutputLengthPredictor, StepCostModel
from loraplex.daemon.scheduler.grammar_book import GrammarBook
from loraplex.daemon.scheduler.kv_pages import KvPages
from loraplex.daemon.scheduler.lookahead import InFlight, awaits_token, fill_placeholder
from loraplex.daemon.scheduler.outputs import TokenRecorder
from loraplex.daemon.scheduler.plan_draft import PlanDraft
from loraplex.daemon.scheduler.prefix_reuse import PrefixReuse
from loraplex.daemon.scheduler.roster import Roster
from loraplex.daemon.scheduler.sequence import SeqRequest, SeqStatus, Sequence
from loraplex.errors import DuplicateRequestError
from loraplex.ipc.engine_plan import RowResult, StepPlan, StepResult

Clock = Callable[[], float]


class BaseScheduler(ABC):
    """Contract: `add` queues a request; `schedule` returns the next StepPlan (None when
    nothing can run) and must be followed by `apply` with its result (or by
    `discard_inflight` when the engine failed it) before the next `schedule`, or by `launch`,
    which lets the next plan be made before this one's result is applied (scheduler.overlap:
    lookahead.py); `take_aborted` hands over requests dropped by early abort since the last call."""

    policy: ClassVar[str] = "base"

    def __init__(self, config: SchedulerConfig, geometry: PageGeometry, allocator: PageAllocator,
                 adapter_pages: Callable[[str], int], eos_token_ids: tuple[int, ...] = (), *,
                 adapter_rank: Callable[[str], int] | None = None, clock: Clock = time.monotonic) -> None:
        self.config = config
        self.geometry = geometry
        self.allocator = allocator
        predictor = None if config.cache_predictor is None else ArrivalPredictor(config.cache_predictor)
        self.prefix_reuse = PrefixReuse(config, allocator, geometry.page_tokens, clock)
        self.adapters = AdapterResidency(allocator, config.cache_policy, predictor=predictor, clock=clock,
                                         prefix=self.prefix_reuse.cache)
        self._adapter_pages = adapter_pages
        # Without ranks, an adapter's page count stands in for its size (it grows with the rank).
        self._adapter_rank = adapter_rank or adapter_pages
        self._clock = clock
        self.roster = Roster()
        self.grammars = GrammarBook()  # what the engine compiled for structured output
        self._wire()
        self._step_ids = itertools.count()
        self.num_preemptions = 0
        self.inflight = InFlight()  # the plan whose result is awaited, and those launched ahead (overlap)
        self._scheduled_at = 0.0
        self.cost = StepCostModel()
        self.predictor = OutputLengthPredictor()
        self.outputs = TokenRecorder(eos_token_ids, config.max_model_len, self.predictor, clock)
        self.admission = SloAdmission(config.ttft_slo_s)
        self._aborted: list[EarlyAbort] = []
        self.clustering = AdapterClustering(config)
        self.draft = PlanDraft()

    # ---- queue ----------------------------------------------------------------------------
    def adopt(self, other: BaseScheduler) -> None:
        """Take over another policy's state between two steps (a run-time policy switch):
        the same allocator, adapter residency, queue and running sequences."""
        if not other.inflight.idle:
            raise RuntimeError("a scheduler can only be switched between steps")
        self.adapters = other.adapters
        self.prefix_reuse = other.prefix_reuse
        self.roster = other.roster
        self.grammars = other.grammars
        self._wire()
        self._step_ids = other._step_ids
        self.num_preemptions = other.num_preemptions
        for seq in list(self.waiting) + self.running:
            self._on_add(seq)

    def _wire(self) -> None:
        """(Re)build the collaborators that act on the adapters, prefix cache and batch held now."""
        self.kv = KvPages(self.config, self.geometry, self.allocator, self.adapters, self._adapter_pages,
                          self.prefix_reuse)
        self.gate = AdmitGate(self.config, self.adapters, self.kv, self.prefix_reuse, self._adapter_pages,
                              self.running, self.grammars)

    @property
    def prefix(self) -> PrefixCache | None:
        """The prefix cache (None: scheduler.prefix_cache is off)."""
        return self.prefix_reuse.cache

    @property
    def waiting(self) -> deque[Sequence]:
        """The queue (Roster.waiting)."""
        return self.roster.waiting

    @property
    def running(self) -> list[Sequence]:
        """The batch (Roster.running)."""
        return self.roster.running

    def requeue(self, seq: Sequence) -> None:
        """Take over a sequence whose KV was lost with its engine (Roster.requeue): sampling
        continues at the same token index, so the client sees neither a gap nor a duplicate."""
        self.roster.requeue(seq)
        self._on_add(seq)

    def add(self, req: SeqRequest) -> Sequence:
        if not req.prompt_ids:
            raise ValueError(f"request {req.request_id!r} has an empty prompt")
        if req.request_id in self.roster:
            raise DuplicateRequestError(f"request id {req.request_id!r} is already in flight")
        self.kv.check_pool(req)
        if req.ttft_slo_s is not None and not (math.isfinite(req.ttft_slo_s) and req.ttft_slo_s > 0):
            raise ValueError(f"request {req.request_id!r}: ttft_slo_s must be a positive number of seconds")
        seq = Sequence(req=req, arrival=self._clock())
        seq.expected_cached = self.prefix_reuse.expected(req)
        self.roster.queue(seq)
        self._on_add(seq)
        return seq

    def abort(self, request_id: str) -> Sequence | None:
        seq = self.roster.get(request_id)
        if seq is None:
            return None
        if seq.status is SeqStatus.WAITING:
            self.waiting.remove(seq)
        self._finish(seq, "cancelled")
        return seq

    def detach(self, request_id: str) -> Sequence | None:
        """Hand a sequence over to another engine (migration): it leaves this scheduler without
        finishing, its KV pages and adapter reference are released, and the receiver `requeue`s
        it (recompute from prompt + tokens so far). None when unknown or in the plan in flight."""
        seq = self.roster.get(request_id)
        if seq is None or self.inflight.holds(request_id):
            return None
        if seq.status is SeqStatus.WAITING:
            self.waiting.remove(seq)
            seq.kv_pages = []  # a preempted sequence's pages were released when it was preempted
            seq.released_pages = 0
            seq.cached_blocks = 0
        else:
            self.running.remove(seq)
            self.kv.release(seq)
        self.roster.leave(seq)
        self.clustering.forget(request_id)
        self._on_finish(seq)
        seq.status = SeqStatus.WAITING
        return seq

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def take_aborted(self) -> list[EarlyAbort]:
        """Requests early abort removed since the last call (already finished here)."""
        aborted, self._aborted = self._aborted, []
        return aborted

    @property
    def merged_adapter(self) -> str | None:
        """The adapter merged into the base weights for the next plan (dLoRA); None: unmerged."""
        return None

    def admission_order(self) -> list[Sequence]:
        """Queued sequences in the order this policy would admit them (for SLO prediction)."""
        return list(self.waiting)

    def adapter_rank(self, name: str | None) -> int:
        return 0 if name is None else self._adapter_rank(name)

    def lanes(self) -> list[dict[str, object]]:
        """The policy's queues for the stats document (MLQ's); none for a single queue."""
        return []

    # ---- planning ----------------------------------------------------------------------------
    def schedule(self) -> StepPlan | None:
        if self.inflight.step_id is not None:
            raise RuntimeError("schedule() called before the previous plan's result was applied")
        now = self._clock()
        self._scheduled_at = now
        if self.admission.default_slo_s is not None or self.roster.own_slo:
            self._early_abort(now)
        self.draft.start(self.config.max_batched_tokens)
        self._forget_awaiting()
        self.adapters.set_queued(s.req.adapter for s in self.waiting)
        self._plan(now)
        if not self.draft and self.adapters.arriving:
            # Nothing runs, so no step will report those loads done: stop waiting for them (a
            # request joins with its adapter still arriving, an eviction waits for the copy).
            self.adapters.set_arriving(())
            self._forget_awaiting()
            self._plan(now)
        if not self.draft:
            return None
        if self.config.prefetch:
            self.kv.prefetch(self.waiting)
        changes = self.adapters.take_changes()
        plan = StepPlan(step_id=next(self._step_ids), rows=self.draft.take_rows(), place=changes.place,
                        evict=changes.evict, merged_adapter=self.merged_adapter, grammars=self.grammars.take_orders())
        self.inflight.step_id = plan.step_id
        return plan

    def _forget_awaiting(self) -> None:
        """Start a planning pass with no one waiting for an adapter (AdmitGate.forget_awaiting)."""
        self.gate.forget_awaiting()

    @abstractmethod
    def _plan(self, now: float) -> None:
        """Fill the plan through `_run` and `_admit` while `self.draft.budget` lasts."""

    def placement_plan(self) -> StepPlan | None:
        """A plan with no rows carrying pending adapter placements (e.g. preloading in cached mode)."""
        if self.inflight.step_id is not None:
            raise RuntimeError("placement_plan() called while a plan is in flight")
        changes = self.adapters.take_changes()
        if not changes.place and not changes.evict:
            return None
        return StepPlan(step_id=next(self._step_ids), rows=[], place=changes.place, evict=changes.evict,
                        merged_adapter=self.merged_adapter)

    def discard_inflight(self) -> None:
        """The engine failed to run the plan in flight and every launched one: their tokens are
        planned again (InFlight.discard)."""
        self.inflight.discard(self.roster.by_id)
        self.grammars.lost()

    def launch(self, plan: StepPlan) -> None:
        """`plan` went to the engine and the next one may be made before its result comes
        (InFlight.launch); `apply` resolves it later."""
        self.inflight.launch(plan, self.roster.by_id)

    def _run(self, seq: Sequence, n: int) -> bool:
        """Plan `n` more tokens of a running sequence (lengthening its row if it has one in this
        plan already); may preempt the newest running sequence for KV pages."""
        if n <= 0 or seq.status is not SeqStatus.RUNNING or self.outputs.reached_length(seq):
            return False
        n = min(n + self.draft.take_back(seq), seq.num_uncomputed)
        if not self._grow_kv(seq, n):
            return False
        self._add_row(seq, n)
        return True

    def _admit(self, seq: Sequence, n: int) -> bool:
        """Move a queued sequence into the batch with its first `n` tokens; False (and nothing
        changed) when a seat, the adapter's pages or the KV pages are not there (admit_gate.py)."""
        if n <= 0 or seq.status is not SeqStatus.WAITING or awaits_token(seq):
            return False
        n = self.gate.enter(seq, n, self.merged_adapter, planning=bool(self.draft))
        if n is None:
            return False
        self.roster.start(seq)
        self.clustering.admitted(seq)
        self._add_row(seq, n)
        self._on_admit(seq)
        return True

    def awaiting_load(self, seq: Sequence) -> bool:
        """This plan left `seq` queued only because its adapter is still arriving: the policy
        may admit the requests behind it (the wait is the copy's, not a lack of resources)."""
        return seq.request_id in self.gate.awaiting

    def waited_for_adapter(self, request_id: str) -> bool:
        """Whether the request was left queued while its adapter was copied to the GPU."""
        seq = self.roster.get(request_id)
        return seq is not None and seq.waited_for_adapter

    def _pick(self, candidates: Seq[Sequence]) -> Sequence:
        """The next candidate to admit (AdapterClustering.pick)."""
        return self.clustering.pick(candidates, self.running)

    def _add_row(self, seq: Sequence, n: int) -> None:
        self.inflight.fed[seq.request_id] = n
        if seq.first_scheduled is None:
            seq.first_scheduled = self._clock()
        self.draft.add(seq, n)

    def _grow_kv(self, seq: Sequence, n: int) -> bool:
        """Give running `seq` the KV pages its next `n` tokens lack, preempting the newest running
        sequences until there is room; False when `seq` itself had to go."""
        self.kv.slide(seq, self.inflight.launched.unsettled(seq))
        need = self.kv.chunk(seq, n)
        while need > 0 and not self.adapters.make_room(need):
            victim = self.running[-1]
            self._preempt(victim)
            if victim is seq:
                return False
        self.kv.allocate(seq, need)
        return True

    def _preempt(self, seq: Sequence) -> None:
        """Recompute-style preemption: drop its KV, send it back to the head of the queue.
        A row already planned for it in this step is taken back out of the plan."""
        self.running.remove(seq)
        self.kv.release(seq)
        self.draft.take_back(seq)
        seq.num_computed = 0
        seq.status = SeqStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.inflight.fed.pop(seq.request_id, None)
        self.waiting.appendleft(seq)
        self._on_preempt(seq)

    def _early_abort(self, now: float) -> None:
        for seq, abort in self.admission.select(self, now):
            self.waiting.remove(seq)
            self._finish(seq, abort.code)
            self._aborted.append(abort)

    # ---- results ----------------------------------------------------------------------------
    def apply(self, plan: StepPlan, result: StepResult) -> list[Sequence]:
        """Fold sampled tokens into the sequences; return those that finished in this step."""
        launched = self.inflight.settle(plan, result)
        self.adapters.set_arriving(result.loading)
        self.grammars.reported(result.grammars_ready)
        step_ms = result.forward_ms + result.sample_ms
        if step_ms <= 0:
            step_ms = (self._clock() - self._scheduled_at) * 1e3
        self.cost.observe(plan.num_tokens, step_ms)
        self._observe(plan, step_ms / 1e3)
        sampled = {r.request_id: r for r in result.rows}
        if launched:
            return self._resolve(plan, sampled)
        finished: list[Sequence] = []
        for row in plan.rows:
            seq = self.roster.get(row.request_id)
            fed = self.inflight.fed.pop(row.request_id, None)
            if seq is None or fed is None or seq.status is not SeqStatus.RUNNING:
                continue  # aborted or preempted while the step ran
            out = sampled.get(row.request_id)
            if out is not None and out.error:  # this row failed on the engine (its KV may not be written)
                self._finish(seq, "error")
                finished.append(seq)
                continue
            seq.num_computed += fed
            self.prefix_reuse.offer(seq, plan.merged_adapter)
            if not row.sample or out is None:
                continue
            reason = self.outputs.append(seq, out)
            if reason is not None:
                self._finish(seq, reason)
                finished.append(seq)
        self.inflight.fed.clear()
        return finished

    def _resolve(self, plan: StepPlan, sampled: dict[str, RowResult]) -> list[Sequence]:
        """A launched plan's result: each sampled token replaces its placeholder (lookahead.py).
        Sequences that left meanwhile (cancelled, finished) are skipped. The full pages this step
        completed join the prefix cache now that their tokens are all known (never those of a
        sequence preempted since: its pages are not the ones this step wrote)."""
        finished: list[Sequence] = []
        for seq, index, preemptions in self.inflight.launched.take(plan):
            out = sampled.get(seq.request_id)
            if self.roster.get(seq.request_id) is not seq or not fill_placeholder(seq, index, out):
                continue
            if out.error:  # the engine could not sample it (its grammar): it fails, as in apply
                del seq.output_ids[index:], seq.logprobs[index:]
                reason: str | None = "error"
            else:
                if seq.status is SeqStatus.RUNNING and seq.num_preemptions == preemptions:
                    self.prefix_reuse.offer(seq, plan.merged_adapter, upto=len(seq.req.prompt_ids) + index)
                reason = self.outputs.resolved(seq, index)
            if reason is not None:
                if seq.status is SeqStatus.WAITING:  # preempted while its token was being sampled
                    self.waiting.remove(seq)
                self._finish(seq, reason)
                finished.append(seq)
        return finished

    def _finish(self, seq: Sequence, reason: str) -> None:
        if seq in self.running:
            self.running.remove(seq)
            self.kv.release(seq)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        self.roster.leave(seq)
        self.inflight.fed.pop(seq.request_id, None)
        self.clustering.forget(seq.request_id)
        self._on_finish(seq)

    # ---- policy hooks (no-ops by default) ----------------------------------------------------
    def _on_add(self, seq: Sequence) -> None:
        """A request was queued."""

    def _on_admit(self, seq: Sequence) -> None:
        """A queued request entered the batch."""

    def _on_preempt(self, seq: Sequence) -> None:
        """A running request went back to the queue (its KV was dropped)."""

    def _on_finish(self, seq: Sequence) -> None:
        """A request left for good (finished, cancelled or aborted)."""

    def _observe(self, plan: StepPlan, step_s: float) -> None:
        """The engine ran `plan` in `step_s` seconds."""

