"""First-come-first-served iteration-level scheduler with continuous batching.

Torch-free policy: once per iteration it turns the queue into a StepPlan
(running sequences first, then waiting ones in arrival order, prefill chunks
and decodes mixed under one token budget), and afterwards folds the sampled
tokens back into the sequences. Pages come from the unified allocator; when
KV pages run out it frees unreferenced adapters, then preempts the newest
running sequence (recompute), so the oldest request always makes progress.
"""
from __future__ import annotations

import itertools
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

from loraplex.daemon.memory.adapter_residency import AdapterResidency
from loraplex.daemon.memory.allocator import KV, PageAllocator
from loraplex.daemon.memory.geometry import PageGeometry
from loraplex.daemon.scheduler.sequence import SeqRequest, SeqStatus, Sequence
from loraplex.errors import CapacityError, DuplicateRequestError
from loraplex.ipc.engine_plan import RowPlan, StepPlan, StepResult


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_batched_tokens: int = 2048
    max_model_len: int = 4096
    load_groups: int = 1  # layer groups a cold adapter is loaded in (1: all before use)

    def __post_init__(self) -> None:
        if min(self.max_num_seqs, self.max_batched_tokens, self.max_model_len, self.load_groups) <= 0:
            raise ValueError("scheduler limits must be positive")


class FcfsScheduler:
    def __init__(self, config: SchedulerConfig, geometry: PageGeometry, allocator: PageAllocator,
                 adapter_pages: Callable[[str], int], eos_token_ids: tuple[int, ...] = ()) -> None:
        self.config = config
        self.geometry = geometry
        self.allocator = allocator
        self.adapters = AdapterResidency(allocator)
        self._adapter_pages = adapter_pages
        self._eos = frozenset(eos_token_ids)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._by_id: dict[str, Sequence] = {}
        self._step_ids = itertools.count()
        self._fed: dict[str, int] = {}  # request id -> tokens fed in the plan in flight
        self.num_preemptions = 0
        self._inflight: int | None = None  # step id of the plan whose result is awaited

    # ---- queue ----------------------------------------------------------------------------
    def add(self, req: SeqRequest) -> Sequence:
        if not req.prompt_ids:
            raise ValueError(f"request {req.request_id!r} has an empty prompt")
        if req.request_id in self._by_id:
            raise DuplicateRequestError(f"request id {req.request_id!r} is already in flight")
        # The whole prompt is prefilled even past max_model_len, so it bounds the need from below.
        worst_len = max(len(req.prompt_ids), min(len(req.prompt_ids) + req.max_tokens, self.config.max_model_len))
        need = self.geometry.kv_pages_for(worst_len)
        if req.adapter is not None:
            need += self._adapter_pages(req.adapter)
        if need > self.allocator.num_pages:
            raise CapacityError(
                f"request {req.request_id!r} needs up to {need} pages; the pool has {self.allocator.num_pages}"
            )
        seq = Sequence(req=req)
        self.waiting.append(seq)
        self._by_id[req.request_id] = seq
        return seq

    def abort(self, request_id: str) -> Sequence | None:
        seq = self._by_id.get(request_id)
        if seq is None:
            return None
        if seq.status is SeqStatus.WAITING:
            self.waiting.remove(seq)
        self._finish(seq, "cancelled")
        return seq

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- planning ----------------------------------------------------------------------------
    def schedule(self) -> StepPlan | None:
        if self._inflight is not None:
            raise RuntimeError("schedule() called before the previous plan's result was applied")
        budget = self.config.max_batched_tokens
        rows: list[RowPlan] = []
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status is not SeqStatus.RUNNING:
                continue  # preempted by an earlier sequence in this loop
            n = min(seq.num_uncomputed, budget)
            if not self._grow_kv(seq, n, allow_preempt=True):
                continue
            rows.append(self._row(seq, n))
            budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            if not self._admit(seq, budget):
                break  # FCFS: the head waits, nothing overtakes it
            n = min(seq.num_uncomputed, budget)
            rows.append(self._row(seq, n))
            budget -= n
        if not rows:
            return None
        changes = self.adapters.take_changes()
        plan = StepPlan(step_id=next(self._step_ids), rows=rows, place=changes.place, evict=changes.evict)
        self._inflight = plan.step_id
        return plan

    def placement_plan(self) -> StepPlan | None:
        """A plan with no rows carrying pending adapter placements (e.g. preloading in cached mode)."""
        if self._inflight is not None:
            raise RuntimeError("placement_plan() called while a plan is in flight")
        changes = self.adapters.take_changes()
        if not changes.place and not changes.evict:
            return None
        return StepPlan(step_id=next(self._step_ids), rows=[], place=changes.place, evict=changes.evict)

    def discard_inflight(self) -> None:
        """The engine failed to run the plan in flight: nothing it planned was computed, so the
        same tokens are simply planned again (pages and adapter placements stay valid)."""
        self._inflight = None
        self._fed.clear()

    def _row(self, seq: Sequence, n: int) -> RowPlan:
        start = seq.num_computed
        self._fed[seq.request_id] = n
        if seq.first_scheduled is None:
            seq.first_scheduled = time.monotonic()
        return RowPlan(
            request_id=seq.request_id,
            token_ids=seq.token_slice(start, start + n),
            start_pos=start,
            kv_pages=list(seq.kv_pages),
            adapter=seq.req.adapter,
            sample=start + n == seq.num_tokens,
            sampling=seq.req.sampling,
            sample_index=len(seq.output_ids),
        )

    def _admit(self, seq: Sequence, budget: int) -> bool:
        adapter = seq.req.adapter
        if adapter is not None and not self.adapters.acquire(adapter, self._adapter_pages(adapter),
                                                             self.config.load_groups):
            return False
        n = min(seq.num_uncomputed, budget)
        if not self._grow_kv(seq, n, allow_preempt=False):
            if adapter is not None:
                self.adapters.release(adapter)
            return False
        self.waiting.popleft()
        seq.status = SeqStatus.RUNNING
        self.running.append(seq)
        return True

    def _grow_kv(self, seq: Sequence, n: int, *, allow_preempt: bool) -> bool:
        need = self.geometry.kv_pages_for(seq.num_computed + n) - len(seq.kv_pages)
        while need > 0 and not self.adapters.make_room(need):
            if not allow_preempt:
                return False
            victim = self.running[-1]
            self._preempt(victim)
            if victim is seq:
                return False
        if need > 0:
            seq.kv_pages += self.allocator.allocate(need, KV)
        return True

    def _preempt(self, seq: Sequence) -> None:
        """Recompute-style preemption: drop its KV, send it back to the head of the queue."""
        self.running.remove(seq)
        self._release(seq)
        seq.num_computed = 0
        seq.status = SeqStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self._fed.pop(seq.request_id, None)
        self.waiting.appendleft(seq)

    # ---- results ----------------------------------------------------------------------------
    def apply(self, plan: StepPlan, result: StepResult) -> list[Sequence]:
        """Fold sampled tokens into the sequences; return those that finished in this step."""
        if plan.step_id != self._inflight or result.step_id != plan.step_id:
            raise ValueError(f"result of step {result.step_id} does not match the plan in flight ({self._inflight})")
        self._inflight = None
        sampled = {r.request_id: r for r in result.rows}
        finished: list[Sequence] = []
        for row in plan.rows:
            seq = self._by_id.get(row.request_id)
            fed = self._fed.pop(row.request_id, None)
            if seq is None or fed is None or seq.status is not SeqStatus.RUNNING:
                continue  # aborted or preempted while the step ran
            seq.num_computed += fed
            out = sampled.get(row.request_id)
            if not row.sample or out is None:
                continue
            if seq.first_token_at is None:
                seq.first_token_at = time.monotonic()
            seq.output_ids.append(out.token_id)
            seq.logprobs.append(out.logprob)
            reason = self._finish_reason(seq, out.token_id)
            if reason is not None:
                self._finish(seq, reason)
                finished.append(seq)
        self._fed.clear()
        return finished

    def _finish_reason(self, seq: Sequence, token: int) -> str | None:
        req = seq.req
        if token in req.stop_token_ids or (not req.ignore_eos and token in self._eos):
            return "stop"
        if len(seq.output_ids) >= req.max_tokens or seq.num_tokens >= self.config.max_model_len:
            return "length"
        return None

    def _finish(self, seq: Sequence, reason: str) -> None:
        if seq in self.running:
            self.running.remove(seq)
            self._release(seq)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        self._by_id.pop(seq.request_id, None)
        self._fed.pop(seq.request_id, None)

    def _release(self, seq: Sequence) -> None:
        self.allocator.free(seq.kv_pages)
        seq.kv_pages = []
        if seq.req.adapter is not None:
            self.adapters.release(seq.req.adapter)
