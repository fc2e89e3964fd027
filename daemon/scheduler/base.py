"""The iteration-level scheduler every policy shares (torch-free).

Owns the queue, the per-request bookkeeping, the unified pages (KV growth,
adapter residency, recompute-style preemption when KV runs out), folding step
results back into sequences, early abort and adapter clustering. A policy only
decides, once per iteration, which sequences get how many tokens: it
implements `_plan` with the helpers `_run` (a running sequence) and `_admit`
(a queued one). Nothing here imports torch or blocks.
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
from loraplex.daemon.memory.allocator import KV, PageAllocator
from loraplex.daemon.memory.prefix_cache import PrefixCache
from loraplex.daemon.scheduler.admission import EarlyAbort, SloAdmission
from loraplex.daemon.scheduler.config import SchedulerConfig
from loraplex.daemon.scheduler.estimators import OutputLengthPredictor, StepCostModel
from loraplex.daemon.scheduler.lookahead import PENDING, LaunchedSteps, awaits_token
from loraplex.daemon.scheduler.sequence import SeqRequest, SeqStatus, Sequence
from loraplex.errors import CapacityError, DuplicateRequestError
from loraplex.ipc.engine_plan import RowPlan, StepPlan, StepResult

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
        self.prefix = None
        if config.prefix_cache:
            budget = None if config.prefix_eviction == "unified" else int(allocator.num_pages * config.prefix_cache_share)
            self.prefix = PrefixCache(allocator, geometry.page_tokens, clock, max_pages=budget)
        self.adapters = AdapterResidency(allocator, config.cache_policy, predictor=predictor, clock=clock,
                                         prefix=self.prefix)
        self._adapter_pages = adapter_pages
        # Without ranks, an adapter's page count stands in for its size (it grows with the rank).
        self._adapter_rank = adapter_rank or adapter_pages
        self._eos = frozenset(eos_token_ids)
        self._clock = clock
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._by_id: dict[str, Sequence] = {}
        self._step_ids = itertools.count()
        self._fed: dict[str, int] = {}  # request id -> tokens fed in the plan in flight
        self.num_preemptions = 0
        self._inflight: int | None = None  # step id of the plan whose result is awaited
        self.launched = LaunchedSteps()  # plans launched ahead of their results (overlap)
        self._scheduled_at = 0.0
        self.cost = StepCostModel()
        self.predictor = OutputLengthPredictor()
        self.admission = SloAdmission(config.ttft_slo_s)
        self._own_slo = 0  # requests in flight with their own TTFT SLO
        self._aborted: list[EarlyAbort] = []
        self._skips: dict[str, int] = {}  # request id -> times passed over by clustering
        self._passed: tuple[Sequence, list[Sequence]] | None = None  # the last clustering pick, and whom it passed
        self._awaiting: set[str] = set()  # request ids this plan left queued while their adapter arrives
        self._held_pages = 0  # free pages held back for them: the KV of their first chunk
        # The plan being built: rows by request id, and the token budget left.
        self._rows: dict[str, RowPlan] = {}
        self._budget = 0

    # ---- queue ----------------------------------------------------------------------------
    def adopt(self, other: BaseScheduler) -> None:
        """Take over another policy's state between two steps (a run-time policy switch):
        the same allocator, adapter residency, queue and running sequences."""
        if other._inflight is not None or len(other.launched):
            raise RuntimeError("a scheduler can only be switched between steps")
        self.adapters = other.adapters
        self.prefix = other.prefix
        self.waiting, self.running, self._by_id = other.waiting, other.running, other._by_id
        self._step_ids = other._step_ids
        self.num_preemptions = other.num_preemptions
        self._own_slo = other._own_slo
        for seq in list(self.waiting) + self.running:
            self._on_add(seq)

    def requeue(self, seq: Sequence) -> None:
        """Take over a sequence whose KV was lost with its engine: it is recomputed from its prompt
        and the tokens it already produced, and sampling continues at the same token index, so
        the client sees neither a gap nor a duplicate."""
        if seq.request_id in self._by_id:
            raise ValueError(f"request {seq.request_id!r} is already queued")
        seq.kv_pages = []
        seq.cached_blocks = 0
        seq.prefix_open = True
        seq.num_computed = 0
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)
        self._by_id[seq.request_id] = seq
        if seq.req.ttft_slo_s is not None:
            self._own_slo += 1
        self._on_add(seq)

    def add(self, req: SeqRequest) -> Sequence:
        if not req.prompt_ids:
            raise ValueError(f"request {req.request_id!r} has an empty prompt")
        if req.request_id in self._by_id:
            raise DuplicateRequestError(f"request id {req.request_id!r} is already in flight")
        need = self._worst_kv_pages(req)
        if req.adapter is not None:
            need += self._adapter_pages(req.adapter)
        if need > self.allocator.num_pages:
            raise CapacityError(
                f"request {req.request_id!r} needs up to {need} pages; the pool has {self.allocator.num_pages}"
            )
        if req.ttft_slo_s is not None:
            if not (math.isfinite(req.ttft_slo_s) and req.ttft_slo_s > 0):
                raise ValueError(f"request {req.request_id!r}: ttft_slo_s must be a positive number of seconds")
            self._own_slo += 1
        seq = Sequence(req=req, arrival=self._clock())
        if self.prefix is not None:
            seq.expected_cached = self.prefix.peek(req.adapter, req.prompt_ids)
        self.waiting.append(seq)
        self._by_id[req.request_id] = seq
        self._on_add(seq)
        return seq

    def abort(self, request_id: str) -> Sequence | None:
        seq = self._by_id.get(request_id)
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
        seq = self._by_id.get(request_id)
        if seq is None or request_id in self._fed or self.launched.holds(request_id):
            return None
        if seq.status is SeqStatus.WAITING:
            self.waiting.remove(seq)
            seq.kv_pages = []  # a preempted sequence's pages were released when it was preempted
            seq.cached_blocks = 0
        else:
            self.running.remove(seq)
            self._release(seq)
        del self._by_id[request_id]
        self._skips.pop(request_id, None)
        if seq.req.ttft_slo_s is not None:
            self._own_slo -= 1
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

    # ---- planning ----------------------------------------------------------------------------
    def schedule(self) -> StepPlan | None:
        if self._inflight is not None:
            raise RuntimeError("schedule() called before the previous plan's result was applied")
        now = self._clock()
        self._scheduled_at = now
        if self.admission.default_slo_s is not None or self._own_slo:
            self._early_abort(now)
        self._rows = {}
        self._forget_awaiting()
        self._budget = self.config.max_batched_tokens
        self.adapters.set_queued(s.req.adapter for s in self.waiting)
        self._plan(now)
        if not self._rows and self.adapters.arriving:
            # Nothing runs, so no step will report those loads done: stop waiting for them (a
            # request joins with its adapter still arriving, an eviction waits for the copy).
            self.adapters.set_arriving(())
            self._forget_awaiting()
            self._plan(now)
        if not self._rows:
            return None
        if self.config.prefetch:
            self._prefetch()
        changes = self.adapters.take_changes()
        plan = StepPlan(step_id=next(self._step_ids), rows=list(self._rows.values()), place=changes.place,
                        evict=changes.evict, merged_adapter=self.merged_adapter)
        self._rows = {}
        self._inflight = plan.step_id
        return plan

    def _forget_awaiting(self) -> None:
        """Start a planning pass with no one waiting for an adapter: a pass planned again must not
        keep the seats and pages the pass it replaces reserved (the waiting request itself could
        no longer fit beside its own reservation: dLoRA, found by the property tests)."""
        self._awaiting = set()
        self._held_pages = 0

    def _prefetch(self) -> None:
        """Place adapters that queued requests will need into free pages, keeping what the head
        of the queue needs next in reserve (a prefetch never evicts and never delays the head)."""
        if not self.waiting:
            return
        head = self.waiting[0]
        reserve = self._pages_wanted(head, self.geometry.kv_pages_for(head.num_tokens + 1))
        budget = self.allocator.num_free - reserve - self._held_pages
        if budget <= 0:
            return
        wanted = list(dict.fromkeys(s.req.adapter for s in list(self.waiting)[:32] if s.req.adapter is not None))
        self.adapters.prefetch(wanted, self._adapter_pages, budget, load_groups=self.config.load_groups)

    @abstractmethod
    def _plan(self, now: float) -> None:
        """Fill the plan through `_run` and `_admit` while `self._budget` lasts."""

    def placement_plan(self) -> StepPlan | None:
        """A plan with no rows carrying pending adapter placements (e.g. preloading in cached mode)."""
        if self._inflight is not None:
            raise RuntimeError("placement_plan() called while a plan is in flight")
        changes = self.adapters.take_changes()
        if not changes.place and not changes.evict:
            return None
        return StepPlan(step_id=next(self._step_ids), rows=[], place=changes.place, evict=changes.evict,
                        merged_adapter=self.merged_adapter)

    def discard_inflight(self) -> None:
        """The engine failed to run the plan in flight (and every launched one): nothing they
        planned was computed, so the same tokens are simply planned again (pages and adapter
        placements stay valid)."""
        self._inflight = None
        self._fed.clear()
        self.launched.rollback(self._by_id)

    def launch(self, plan: StepPlan) -> None:
        """`plan` went to the engine and the next one may be made before its result comes:
        its sequences advance as if it had run (lookahead.py); `apply` resolves it later."""
        if plan.step_id != self._inflight:
            raise ValueError(f"step {plan.step_id} is not the plan in flight ({self._inflight})")
        self.launched.launch(plan, self._fed, self._by_id)
        self._fed.clear()
        self._inflight = None

    def _run(self, seq: Sequence, n: int) -> bool:
        """Plan `n` more tokens of a running sequence (lengthening its row if it has one in this
        plan already); may preempt the newest running sequence for KV pages."""
        if n <= 0 or seq.status is not SeqStatus.RUNNING or self._reached_length(seq):
            return False
        row = self._rows.pop(seq.request_id, None)
        if row is not None:
            self._budget += len(row.token_ids)
            n += len(row.token_ids)
        n = min(n, seq.num_uncomputed)
        if not self._grow_kv(seq, n, allow_preempt=True):
            return False
        self._add_row(seq, n)
        return True

    def planned(self, seq: Sequence) -> int:
        """Tokens of `seq` in the plan being built."""
        row = self._rows.get(seq.request_id)
        return 0 if row is None else len(row.token_ids)

    def _admit(self, seq: Sequence, n: int) -> bool:
        """Move a queued sequence into the batch with its first `n` tokens; False (and nothing
        changed) when a seat, the adapter's pages or the KV pages are not there."""
        if n <= 0 or seq.status is not SeqStatus.WAITING or awaits_token(seq) or not self._has_seat(seq):
            return False
        adapter = seq.req.adapter
        if seq.num_preemptions and not self._context_fits(seq):
            return False
        if self._awaiting and not self._leaves_room_for_awaiting(seq, n):
            return False
        if self._prefix_in_flight(seq):
            # Wait a step or two for a running sequence to compute (and cache) the prompt pages
            # this one shares with it, instead of computing them twice (n > 1 siblings, a burst
            # of one system prompt); like a request awaiting its adapter, others may pass it.
            self._awaiting.add(seq.request_id)
            self._held_pages += self._chunk_kv_pages(seq, n)
            return False
        if adapter is not None and self._must_await_load(adapter):
            if self.adapters.place_ahead(adapter, self._adapter_pages(adapter), self.config.load_groups):
                self._awaiting.add(seq.request_id)
                self._held_pages += self._chunk_kv_pages(seq, n)
                seq.waited_for_adapter = True
            return False
        if adapter is not None and not self.adapters.acquire(adapter, self._adapter_pages(adapter),
                                                             self.config.load_groups):
            return False
        n = self._reuse_prefix(seq, n)
        if not self._grow_kv(seq, n, allow_preempt=False):
            self._drop_kv(seq)
            seq.num_computed = 0
            if adapter is not None:
                self.adapters.release(adapter, backout=True)
            return False
        if self.waiting and self.waiting[0] is seq:
            self.waiting.popleft()
        else:
            self.waiting.remove(seq)
        seq.status = SeqStatus.RUNNING
        self.running.append(seq)
        self._skips.pop(seq.request_id, None)
        if self._passed is not None and self._passed[0] is seq:
            for skipped in self._passed[1]:
                self._skips[skipped.request_id] = self._skips.get(skipped.request_id, 0) + 1
        self._passed = None
        self._add_row(seq, n)
        self._on_admit(seq)
        return True

    def _reuse_prefix(self, seq: Sequence, n: int) -> int:
        """A sequence entering the batch with no KV takes the longest cached prefix of its tokens
        (computed with its adapter) as computed; returns the tokens to feed now, at most `n`."""
        if not self._may_reuse_prefix(seq):
            return n
        pages = self.prefix.match(seq.req.adapter, seq.token_slice(0, seq.num_tokens), self._merged(seq))
        if not pages:
            return n
        seq.kv_pages = pages
        seq.cached_blocks = len(pages)
        seq.num_computed = len(pages) * self.geometry.page_tokens
        if seq.first_scheduled is None:
            seq.cached_tokens = seq.num_computed
        return min(n, seq.num_uncomputed)

    def _may_reuse_prefix(self, seq: Sequence) -> bool:
        """A sequence with no KV may start from cached pages, unless its sampling needs every token
        it has seen fed to the engine (penalties, a grammar: the sampler rebuilds that history
        from the rows it runs, so such a request computes its whole prompt)."""
        return (self.prefix is not None and not seq.kv_pages and not seq.num_computed
                and not seq.req.sampling.needs_history)

    def _prefix_in_flight(self, seq: Sequence) -> bool:
        """Whether a running sequence with the same adapter is computing, in its prefill, the next
        full page of `seq`'s prompt that the prefix cache does not hold yet."""
        if not self._may_reuse_prefix(seq):
            return False
        # Cheap first (this runs at every admission attempt): a running prefill of its adapter.
        adapter, prompt = seq.req.adapter, seq.req.prompt_ids
        prefilling = [o for o in self.running if o.req.adapter == adapter and o.num_computed < len(o.req.prompt_ids) - 1]
        if not prefilling:
            return False
        size = self.geometry.page_tokens
        start = self.prefix.peek(adapter, prompt, self._merged(seq))
        if len(prompt) - start <= size:
            return False  # no full page left to share (its last token is computed anyway)
        block = prompt[start:start + size]
        for other in prefilling:
            theirs = other.req.prompt_ids
            if other.num_computed < start + size <= len(theirs) - 1 and theirs[start:start + size] == block:
                return True
        return False

    def _merged(self, seq: Sequence) -> bool:
        """Whether `seq`'s adapter runs merged into the base weights (dLoRA): its KV differs in
        rounding from the unmerged path's, so the two are cached apart."""
        return seq.req.adapter is not None and seq.req.adapter == self.merged_adapter

    def _cache_prefix(self, seq: Sequence, merged: bool, upto: int | None = None) -> None:
        """Offer the full pages `seq` has computed (its first `upto` tokens, when launched steps
        count more as computed than the engine has reported) to the prefix cache."""
        size = self.geometry.page_tokens
        computed = seq.num_computed if upto is None else min(upto, seq.num_computed)
        full = min(computed // size, len(seq.kv_pages))
        first = seq.cached_blocks
        if self.prefix is None or not seq.prefix_open or full <= first:
            return
        tokens = seq.token_slice(first * size, full * size)
        if PENDING in tokens:
            return  # a launched step's token not known yet: offered when its result comes
        seq.cached_blocks = self.prefix.insert(seq.req.adapter, seq.kv_pages, first, tokens, merged)
        seq.prefix_open = seq.cached_blocks == full

    def _must_await_load(self, adapter: str) -> bool:
        """With admit_when_loaded, a request whose adapter is not yet fully on the GPU waits in
        the queue while it loads, rather than stalling every row of the step on the copy; when
        nothing else would run it is admitted at once and the step overlaps the load."""
        return (self.config.admit_when_loaded and bool(self._rows or self.running)
                and not self.adapters.is_ready(adapter)
                and self.adapters.refs(adapter) == 0)  # a running user's rows wait for it anyway

    def _worst_kv_pages(self, req: SeqRequest) -> int:
        """KV pages a request needs at most (the whole prompt is prefilled even past
        max_model_len, so it bounds the need from below)."""
        worst_len = max(len(req.prompt_ids), min(len(req.prompt_ids) + req.max_tokens, self.config.max_model_len))
        return self.geometry.kv_pages_for(worst_len)

    def _context_fits(self, seq: Sequence) -> bool:
        """Whether all the KV `seq` can still need fits in free and reclaimable pages. A preempted
        sequence comes back only then: admitted on its first chunk alone, it could run out of
        pages again and preempt itself, over and over, while the sequence holding the pages
        never got the token budget to finish (MLQ, a one-token budget: found by the property
        tests). Its own adapter, resident but unreferenced while it waits, is counted once: as
        pages it keeps, not also as reclaimable room for its KV (counted twice, a preempted
        sequence came back into a pool one page short and preempted itself again, forever:
        MLQ, seen once in two runs of the suite)."""
        need = self._pages_wanted(seq, self._worst_kv_pages(seq.req))
        room = self.allocator.num_free + self.adapters.reclaimable_pages()
        adapter = seq.req.adapter
        if adapter is not None and adapter in self.adapters.eviction_order():
            room -= len(self.adapters.resident_pages(adapter))
        return need <= room

    def _leaves_room_for_awaiting(self, seq: Sequence, n: int) -> bool:
        """A request may pass those waiting for their adapter only with a seat and free pages
        to spare for them, so that passing never delays them once their copy is in."""
        if len(self.running) + len(self._awaiting) >= self.config.max_num_seqs:
            return False
        need = self._pages_wanted(seq, self.geometry.kv_pages_for(seq.num_computed + n))
        return need <= self.allocator.num_free - self._held_pages

    def _pages_wanted(self, seq: Sequence, kv_pages: int) -> int:
        """Pages `seq` still lacks to hold `kv_pages` of KV, with its adapter placed."""
        need = kv_pages - len(seq.kv_pages)
        adapter = seq.req.adapter
        if adapter is not None and not self.adapters.is_resident(adapter):
            need += self._adapter_pages(adapter)
        return need

    def _chunk_kv_pages(self, seq: Sequence, n: int) -> int:
        """KV pages `seq` lacks to compute its next `n` tokens."""
        return self.geometry.kv_pages_for(seq.num_computed + n) - len(seq.kv_pages)

    def awaiting_load(self, seq: Sequence) -> bool:
        """This plan left `seq` queued only because its adapter is still arriving: the policy
        may admit the requests behind it (the wait is the copy's, not a lack of resources)."""
        return seq.request_id in self._awaiting

    def waited_for_adapter(self, request_id: str) -> bool:
        """Whether the request was left queued while its adapter was copied to the GPU."""
        seq = self._by_id.get(request_id)
        return seq is not None and seq.waited_for_adapter

    def _has_seat(self, seq: Sequence) -> bool:
        if len(self.running) >= self.config.max_num_seqs:
            return False
        limit = self.config.max_loras_per_batch
        adapter = seq.req.adapter
        if limit and adapter is not None:
            active = {s.req.adapter for s in self.running if s.req.adapter is not None}
            return adapter in active or len(active) < limit
        return True

    def _pick(self, candidates: Seq[Sequence]) -> Sequence:
        """The next candidate to admit: the first, or with adapter clustering the first whose
        adapter already runs (base-model requests always share), unless one was passed over
        `cluster_max_skips` times."""
        if not self.config.cluster_adapters or len(candidates) == 1:
            return candidates[0]
        limit = self.config.cluster_max_skips
        for seq in candidates:
            if self._skips.get(seq.request_id, 0) >= limit:
                return seq
        active = {s.req.adapter for s in self.running}
        for i, seq in enumerate(candidates):
            if seq.req.adapter is None or seq.req.adapter in active:
                self._passed = (seq, list(itertools.islice(candidates, i)))  # counted if `seq` is admitted
                return seq
        return candidates[0]

    def _add_row(self, seq: Sequence, n: int) -> None:
        start = seq.num_computed
        self._fed[seq.request_id] = n
        if seq.first_scheduled is None:
            seq.first_scheduled = self._clock()
        self._rows[seq.request_id] = RowPlan(
            request_id=seq.request_id,
            token_ids=seq.token_slice(start, start + n),
            start_pos=start,
            kv_pages=list(seq.kv_pages),
            adapter=seq.req.adapter,
            sample=start + n == seq.num_tokens,
            sampling=seq.req.sampling,
            sample_index=len(seq.output_ids),
        )
        self._budget -= n

    def _grow_kv(self, seq: Sequence, n: int, *, allow_preempt: bool) -> bool:
        need = self._chunk_kv_pages(seq, n)
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
        """Recompute-style preemption: drop its KV, send it back to the head of the queue.
        A row already planned for it in this step is taken back out of the plan."""
        self.running.remove(seq)
        self._release(seq)
        row = self._rows.pop(seq.request_id, None)
        if row is not None:
            self._budget += len(row.token_ids)
        seq.num_computed = 0
        seq.status = SeqStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self._fed.pop(seq.request_id, None)
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
        launched = plan.step_id != self._inflight and len(self.launched) > 0
        if (not launched and plan.step_id != self._inflight) or result.step_id != plan.step_id:
            raise ValueError(f"result of step {result.step_id} does not match the plan in flight ({self._inflight})")
        if not launched:
            self._inflight = None
        self.adapters.set_arriving(result.loading)
        step_ms = result.forward_ms + result.sample_ms
        if step_ms <= 0:
            step_ms = (self._clock() - self._scheduled_at) * 1e3
        self.cost.observe(plan.num_tokens, step_ms)
        self._observe(plan, step_ms / 1e3)
        sampled = {r.request_id: r for r in result.rows}
        if launched:
            return self._resolve(self.launched.take(plan), sampled, plan.merged_adapter)
        finished: list[Sequence] = []
        for row in plan.rows:
            seq = self._by_id.get(row.request_id)
            fed = self._fed.pop(row.request_id, None)
            if seq is None or fed is None or seq.status is not SeqStatus.RUNNING:
                continue  # aborted or preempted while the step ran
            seq.num_computed += fed
            self._cache_prefix(seq, merged=row.adapter is not None and row.adapter == plan.merged_adapter)
            out = sampled.get(row.request_id)
            if not row.sample or out is None:
                continue
            if out.error:  # the engine could not sample it (its grammar): it fails
                self._finish(seq, "error")
                finished.append(seq)
                continue
            if seq.first_token_at is None:
                seq.first_token_at = self._clock()
            seq.output_ids.append(out.token_id)
            seq.logprobs.append(out.logprob)
            if out.top_ids:
                seq.top_logprobs.append(dict(zip(out.top_ids, out.top_logprobs)))
            reason = self._finish_reason(seq, out.token_id)
            if reason is not None:
                self.predictor.observe(seq.req.adapter, len(seq.output_ids))
                self._finish(seq, reason)
                finished.append(seq)
        self._fed.clear()
        return finished

    def _resolve(self, rows: list[tuple[Sequence, int, int]], sampled: dict, merged: str | None) -> list[Sequence]:
        """A launched plan's result: each sampled token replaces its placeholder; a sequence that
        finished on it drops the placeholders after it (its row in the next launched plan was
        wasted). Sequences that left meanwhile (cancelled, finished) are skipped. The full pages
        this step completed join the prefix cache now that their tokens are all known (never
        those of a sequence preempted since: its pages are not the ones this step wrote)."""
        finished: list[Sequence] = []
        for seq, index, preemptions in rows:
            out = sampled.get(seq.request_id)
            if self._by_id.get(seq.request_id) is not seq or out is None or index >= len(seq.output_ids) \
                    or seq.output_ids[index] != PENDING:
                continue
            seq.output_ids[index] = out.token_id
            seq.logprobs[index] = out.logprob
            if seq.status is SeqStatus.RUNNING and seq.num_preemptions == preemptions:
                self._cache_prefix(seq, merged=merged is not None and seq.req.adapter == merged,
                                   upto=len(seq.req.prompt_ids) + index)
            if seq.first_token_at is None:
                seq.first_token_at = self._clock()
            reason = self._finish_reason(seq, out.token_id, index + 1)
            if reason is not None:
                del seq.output_ids[index + 1:], seq.logprobs[index + 1:]
                self.predictor.observe(seq.req.adapter, len(seq.output_ids))
                if seq.status is SeqStatus.WAITING:  # preempted while its token was being sampled
                    self.waiting.remove(seq)
                self._finish(seq, reason)
                finished.append(seq)
        return finished

    def _reached_length(self, seq: Sequence) -> bool:
        """Launched steps already gave it its last token (max_tokens or the context): a finish
        known in advance, so it is not planned again (a no-op without launched steps)."""
        return len(seq.output_ids) >= seq.req.max_tokens or seq.num_tokens >= self.config.max_model_len

    def _finish_reason(self, seq: Sequence, token: int, produced: int | None = None) -> str | None:
        """Why `seq` finishes on `token`, its `produced`-th output (default: its last one), if it does."""
        req = seq.req
        if token in req.stop_token_ids or (not req.ignore_eos and token in self._eos):
            return "stop"
        produced = len(seq.output_ids) if produced is None else produced
        if produced >= req.max_tokens or len(req.prompt_ids) + produced >= self.config.max_model_len:
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
        self._skips.pop(seq.request_id, None)
        if seq.req.ttft_slo_s is not None:
            self._own_slo -= 1
        self._on_finish(seq)

    def _release(self, seq: Sequence) -> None:
        self._drop_kv(seq)
        if seq.req.adapter is not None:
            self.adapters.release(seq.req.adapter)

    def _drop_kv(self, seq: Sequence) -> None:
        """Give back `seq`'s KV pages: its own are freed, cached ones lose its reference."""
        own = seq.kv_pages if self.prefix is None else self.prefix.release(seq.kv_pages)
        self.allocator.free(own)
        seq.kv_pages = []
        seq.cached_blocks = 0
        seq.prefix_open = True

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

