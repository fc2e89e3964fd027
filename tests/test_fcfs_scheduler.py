"""FCFS scheduler driven against a fake engine that keeps a real paged KV store.

The fake engine reads each row's context back out of the pages the plan names,
so a page shared between live sequences, freed too early or not refilled after
preemption shows up as a wrong token; the token itself is a pure function of
(adapter, seed, context), so every request has one correct output however it
was batched, chunked or preempted.
"""
from __future__ import annotations

import dataclasses
import random
import subprocess
import sys
import zlib
from typing import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loraplex.contracts.geometry import PageGeometry
from loraplex.daemon.memory.allocator import ADAPTER, KV, PageAllocator
from loraplex.daemon.scheduler.fcfs import FcfsScheduler, SchedulerConfig
from loraplex.daemon.scheduler.lookahead import PENDING
from loraplex.daemon.scheduler.sequence import SeqRequest, SeqStatus, Sequence
from loraplex.errors import CapacityError, DuplicateRequestError
from loraplex.ipc.engine_plan import RowResult, SamplingSpec, StepPlan, StepResult

VOCAB = 40
EOS = 2
ADAPTER_PAGES = {"ada": 1, "bob": 2, "cat": 3}
TokenFn = Callable[[str | None, int, list[int]], int]


def model_token(adapter: str | None, seed: int, context: list[int]) -> int:
    """The fake model: the next token depends on the adapter, the seed and the whole context."""
    return zlib.crc32(f"{adapter}|{seed}|{context}".encode()) % VOCAB


def reference(req: SeqRequest, max_model_len: int, token_fn: TokenFn = model_token) -> tuple[list[int], str]:
    """What the request must produce when run alone, one token at a time."""
    out: list[int] = []
    while True:
        tok = token_fn(req.adapter, req.sampling.seed, req.prompt_ids + out)
        out.append(tok)
        if tok in req.stop_token_ids or (not req.ignore_eos and tok == EOS):
            return out, "stop"
        if len(out) >= req.max_tokens or len(req.prompt_ids) + len(out) >= max_model_len:
            return out, "length"


class FakeEngine:
    """Executes plans against a KV store keyed by (page, element offset) and checks the plan contract."""

    def __init__(self, sched: FcfsScheduler, token_fn: TokenFn = model_token) -> None:
        self.sched = sched
        self.token_fn = token_fn
        self.kv: dict[tuple[int, int], tuple[str, int, int]] = {}  # slot -> (request, position, token)
        self.adapters: dict[str, list[int]] = {}
        self.seqs: dict[str, Sequence] = {}
        self.first_step: dict[str, int] = {}
        self.steps = 0
        self.last_step_id = -1
        self.last_sampled: dict[str, int] = {}  # what PENDING means in the next step (overlap)
        self.fed: dict[str, list[int]] = {}  # request -> the tokens this engine fed it, by position
        self.samples: list[tuple[str, int]] = []  # (request, output index) of every sampling row run

    def add(self, req: SeqRequest) -> Sequence:
        seq = self.sched.add(req)
        self.seqs[req.request_id] = seq
        return seq

    def execute(self, plan: StepPlan) -> StepResult:
        cfg, geometry = self.sched.config, self.sched.geometry
        assert plan.step_id > self.last_step_id
        self.last_step_id = plan.step_id
        for name in plan.evict:
            del self.adapters[name]
        for placement in plan.place:
            assert placement.name not in self.adapters
            self.adapters[placement.name] = list(placement.pages)
        assert plan.rows, "an empty plan"
        assert plan.num_tokens <= cfg.max_batched_tokens, "token budget exceeded"
        assert len(plan.rows) <= cfg.max_num_seqs
        assert len({r.request_id for r in plan.rows}) == len(plan.rows)
        adapter_pages = {p for pages in self.adapters.values() for p in pages}
        assert len(adapter_pages) == sum(len(p) for p in self.adapters.values()), "adapters share a page"
        written: set[int] = set()  # pages some row writes KV into in this step
        read: set[int] = set()  # pages of every row's table
        results = []
        for row in plan.rows:
            seq = self.seqs[row.request_id]
            self.first_step.setdefault(row.request_id, self.steps)
            full = seq.req.prompt_ids + seq.output_ids
            end = row.start_pos + len(row.token_ids)
            assert row.token_ids and row.token_ids == full[row.start_pos:end]
            assert row.sample == (end == len(full)), "only the last chunk samples"
            assert row.sample_index == len(seq.output_ids)
            assert row.adapter == seq.req.adapter
            if row.adapter is not None:
                assert row.adapter in self.adapters, "row uses an adapter the engine does not hold"
            assert len(row.kv_pages) >= geometry.kv_pages_for(end), "page table does not cover the row"
            assert len(set(row.kv_pages)) == len(row.kv_pages)
            assert not adapter_pages & set(row.kv_pages), "a KV page is also an adapter's"
            mine = {row.kv_pages[geometry.kv_slot(pos)[0]] for pos in range(row.start_pos, end)}
            assert not mine & (written | read), "a row writes a page another row of the step uses"
            assert not (set(row.kv_pages) - mine) & written, "a row reads a page another row writes"
            written |= mine
            read |= set(row.kv_pages)
            # What this engine fed at each position (overlap: a PENDING output in `full` is the token
            # it sampled); past what it fed for this request (a prefix cached by another), the prompt.
            fed = self.fed.get(row.request_id, [])
            known = fed[:row.start_pos] + full[len(fed):row.start_pos]
            assert PENDING not in known
            for pos in range(row.start_pos):  # read the computed prefix back from its pages
                page, off = geometry.kv_slot(pos)
                entry = self.kv.get((row.kv_pages[page], off))
                # The KV at a position is the same only for the same adapter and the same tokens
                # up to it (a prefix shared between requests, or the request's own).
                assert entry == (row.adapter, tuple(known[:pos + 1])), f"KV of position {pos} lost"
            # A launched step's token (overlap) is fed as the one this engine sampled for the row.
            seen = known + [self.last_sampled[row.request_id] if t == PENDING else t for t in row.token_ids]
            for pos in range(row.start_pos, end):
                page, off = geometry.kv_slot(pos)
                self.kv[(row.kv_pages[page], off)] = (row.adapter, tuple(seen[:pos + 1]))
            self.fed[row.request_id] = seen
            context = seen
            if row.sample:
                tok = self.token_fn(row.adapter, row.sampling.seed, context)
                results.append(RowResult(request_id=row.request_id, token_id=tok, logprob=None))
                self.samples.append((row.request_id, row.sample_index))
        self.last_sampled = {r.request_id: r.token_id for r in results}
        self.steps += 1
        return StepResult(step_id=plan.step_id, rows=results)

    def run_overlapped(self, rng: random.Random | None = None, max_steps: int = 20_000) -> list[Sequence]:
        """As the daemon's overlapped step loop drives it: up to two steps sent, each planned
        before the one before it was applied; with `rng`, some steps fail, taking back both."""
        finished: list[Sequence] = []
        inflight: list[tuple[StepPlan, StepResult]] = []
        while self.sched.has_work() or inflight:
            plan = self.sched.schedule() if len(inflight) < 2 else None
            if plan is not None:
                inflight.append((plan, self.execute(plan)))  # the engine runs steps in order
                self.sched.launch(plan)
            elif rng is not None and rng.random() < 0.1:
                inflight.clear()  # the oldest step failed: the next was planned on it
                self.sched.discard_inflight()
                self.last_sampled = {}
            else:
                assert inflight, "requests queued but nothing scheduled"
                finished += self.sched.apply(*inflight.pop(0))
            assert self.steps < max_steps
        assert self.sched.schedule() is None
        return finished

    def run(self, max_steps: int = 20_000) -> list[Sequence]:
        finished: list[Sequence] = []
        while self.sched.has_work():
            plan = self.sched.schedule()
            assert plan is not None, "requests queued but nothing scheduled"
            finished += self.sched.apply(plan, self.execute(plan))
            assert self.steps < max_steps
        assert self.sched.schedule() is None
        return finished


def make(num_pages: int, *, page_tokens: int = 4, max_batched_tokens: int = 64, max_num_seqs: int = 16,
         max_model_len: int = 4096, prefix_cache: bool = False) -> FcfsScheduler:
    """A scheduler for page-accounting tests: without the prefix cache unless asked (its pages
    stay allocated after their sequences; tests/test_prefix_cache.py covers it)."""
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_batched_tokens=max_batched_tokens,
                             max_model_len=max_model_len, max_loras_per_batch=0, admit_when_loaded=False,
                             prefix_cache=prefix_cache)
    geometry = PageGeometry(kv_dim=2, page_tokens=page_tokens, max_row_width=0)
    return FcfsScheduler(config, geometry, PageAllocator(num_pages), ADAPTER_PAGES.__getitem__, (EOS,))


def request(rid: str, prompt: list[int], max_tokens: int, adapter: str | None = None, *, seed: int = 0,
            ignore_eos: bool = True, stop: frozenset[int] = frozenset()) -> SeqRequest:
    return SeqRequest(request_id=rid, prompt_ids=prompt, adapter=adapter, sampling=SamplingSpec(seed=seed),
                      max_tokens=max_tokens, stop_token_ids=stop, ignore_eos=ignore_eos)


def worst_pages(req: SeqRequest, geometry: PageGeometry, max_model_len: int) -> int:
    kv_len = max(len(req.prompt_ids), min(len(req.prompt_ids) + req.max_tokens, max_model_len))
    return geometry.kv_pages_for(kv_len) + (ADAPTER_PAGES[req.adapter] if req.adapter else 0)


def assert_drained(sched: FcfsScheduler) -> None:
    """Nothing in flight: no KV page held but idle cached prefixes, adapters resident but unreferenced."""
    usage = sched.allocator.usage()
    cached = 0 if sched.prefix is None else sched.prefix.num_pages
    assert sched.prefix is None or sched.prefix.idle_pages == cached, "a cached prefix page is still referenced"
    assert usage.by_tag.get(KV, 0) == cached, "KV pages leaked"
    assert usage.by_tag.get(ADAPTER, 0) == sum(ADAPTER_PAGES[n] for n in sched.adapters.resident_names())
    assert all(sched.adapters.refs(n) == 0 for n in sched.adapters.resident_names())
    assert not sched.running and not sched.waiting


@st.composite
def workloads(draw):
    page_tokens = draw(st.sampled_from([1, 2, 4, 8]))
    max_model_len = draw(st.integers(8, 64))
    reqs = []
    # Some prompts start with one shared prefix, so that the prefix cache (when drawn) finds pages.
    shared = draw(st.lists(st.integers(0, VOCAB - 1), max_size=16))
    for i in range(draw(st.integers(1, 10))):
        own = draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=min(24, max_model_len - 1)))
        prompt = ((shared if draw(st.booleans()) else []) + own)[-(max_model_len - 1):]
        reqs.append(request(
            f"r{i}", prompt, draw(st.integers(1, 16)), draw(st.sampled_from([None, None, *ADAPTER_PAGES])),
            seed=draw(st.integers(0, 3)), ignore_eos=draw(st.booleans()),
            stop=frozenset(draw(st.lists(st.integers(0, VOCAB - 1), max_size=2))),
        ))
    return dict(page_tokens=page_tokens, max_model_len=max_model_len, reqs=reqs,
                slack=draw(st.sampled_from([0, 0, 1, 3, 10, 200])),
                max_batched_tokens=draw(st.integers(1, 40)), max_num_seqs=draw(st.integers(1, 6)),
                prefix_cache=draw(st.booleans()))


def workload_engine(w) -> tuple[FcfsScheduler, FakeEngine, list[Sequence]]:
    """A pool just large enough for the workload's biggest request, plus its slack; its requests queued."""
    geometry = PageGeometry(kv_dim=2, page_tokens=w["page_tokens"], max_row_width=0)
    biggest = max(worst_pages(r, geometry, w["max_model_len"]) for r in w["reqs"])
    sched = make(biggest + w["slack"], page_tokens=w["page_tokens"], max_batched_tokens=w["max_batched_tokens"],
                 max_num_seqs=w["max_num_seqs"], max_model_len=w["max_model_len"], prefix_cache=w["prefix_cache"])
    engine = FakeEngine(sched)
    return sched, engine, [engine.add(r) for r in w["reqs"]]


@settings(max_examples=60, deadline=None)
@given(workloads())
def test_random_workloads_finish_with_the_reference_tokens(w) -> None:
    sched, engine, seqs = workload_engine(w)
    finished = engine.run()
    assert sorted(s.request_id for s in finished) == sorted(r.request_id for r in w["reqs"])
    for seq in seqs:
        tokens, reason = reference(seq.req, w["max_model_len"])
        assert (seq.output_ids, seq.finish_reason) == (tokens, reason), seq.request_id
        assert seq.status is SeqStatus.FINISHED and seq.kv_pages == []
        req = seq.req
        if req.ignore_eos and not req.stop_token_ids and len(req.prompt_ids) + req.max_tokens <= w["max_model_len"]:
            assert len(seq.output_ids) == req.max_tokens
    # FCFS: a request is first scheduled no earlier than any request that arrived before it
    # (with the prefix cache, one waiting for a prompt page another computes may be passed).
    order = [engine.first_step[r.request_id] for r in w["reqs"]]
    assert w["prefix_cache"] or order == sorted(order)
    assert_drained(sched)


@settings(max_examples=60, deadline=None)
@given(workloads(), st.integers(0, 1 << 30), st.booleans())
def test_overlapped_steps_finish_with_the_reference_tokens(w, seed: int, failures: bool) -> None:
    """One step planned ahead (scheduler.overlap): the same tokens as run alone, however steps
    were batched, preempted or failed; a request that finished costs at most one wasted row."""
    sched, engine, seqs = workload_engine(w)
    finished = engine.run_overlapped(random.Random(seed) if failures else None)
    assert sorted(s.request_id for s in finished) == sorted(r.request_id for r in w["reqs"])
    for seq in seqs:
        assert (seq.output_ids, seq.finish_reason) == reference(seq.req, w["max_model_len"]), seq.request_id
        assert seq.status is SeqStatus.FINISHED and seq.kv_pages == []
    if not failures:
        final = {s.request_id: s for s in seqs}
        wasted = [rid for rid, index in engine.samples if index >= len(final[rid].output_ids)]
        assert len(wasted) == len(set(wasted)), "a finished request ran more than one row"
        # A length finish is known in advance: only a sampled stop wastes a row.
        assert all(final[rid].finish_reason == "stop" for rid in wasted)
    assert_drained(sched)


@pytest.mark.parametrize("overlapped", [False, True])
def test_a_row_the_engine_could_not_sample_fails_its_request_only(overlapped: bool) -> None:
    """A RowResult with an error (its grammar did not compile) finishes that request with "error",
    keeping only the tokens before it, in both loops; the others get their reference tokens."""
    rng = random.Random()
    bad_at = rng.randrange(1, 6)
    reqs = [request(f"r{i}", [rng.randrange(VOCAB) for _ in range(rng.randrange(3, 12))], 12,
                    adapter=[None, "bob"][i % 2], seed=i, ignore_eos=True) for i in range(4)]

    class FailingEngine(FakeEngine):
        def execute(self, plan: StepPlan) -> StepResult:
            result = super().execute(plan)
            rows = [dataclasses.replace(r, error="grammar failed") if r.request_id == "r1"
                    and self.samples and (r.request_id, bad_at) in self.samples[-len(plan.rows):] else r
                    for r in result.rows]
            return dataclasses.replace(result, rows=rows)

    sched = make(200)
    engine = FailingEngine(sched)
    seqs = [engine.add(r) for r in reqs]
    finished = engine.run_overlapped() if overlapped else engine.run()
    assert sorted(s.request_id for s in finished) == [r.request_id for r in reqs]
    for seq in seqs:
        tokens, reason = reference(seq.req, 4096)
        if seq.request_id == "r1":
            assert (seq.output_ids, seq.finish_reason) == (tokens[:bad_at], "error")
        else:
            assert (seq.output_ids, seq.finish_reason) == (tokens, reason), seq.request_id
    assert_drained(sched)


def test_tiny_pool_preempts_and_recomputes_to_the_same_tokens() -> None:
    reqs = [request(f"r{i}", [(7 * i + j) % VOCAB for j in range(10 + i)], 30, adapter=[None, "bob"][i % 2], seed=i)
            for i in range(6)]
    tiny = max(worst_pages(r, PageGeometry(kv_dim=2, page_tokens=4, max_row_width=0), 4096) for r in reqs)
    assert tiny == 14  # r5: 15 + 30 tokens in 12 KV pages, and 2 adapter pages
    outputs = {}
    for num_pages in (tiny, 500):
        sched = make(num_pages, page_tokens=4, max_batched_tokens=32)
        engine = FakeEngine(sched)
        seqs = [engine.add(r) for r in reqs]
        engine.run()
        preemptions = sum(s.num_preemptions for s in seqs)
        assert (preemptions > 0) == (num_pages == tiny)
        outputs[num_pages] = [s.output_ids for s in seqs]
        assert all(len(s.output_ids) == 30 for s in seqs)
        assert_drained(sched)
    assert outputs[tiny] == outputs[500] == [reference(r, 4096)[0] for r in reqs]


def test_chunked_prefill_samples_only_on_the_last_chunk() -> None:
    sched = make(64, page_tokens=4, max_batched_tokens=8)
    engine = FakeEngine(sched)
    engine.add(request("long", list(range(30)), 3))
    rows = []
    while sched.has_work():
        plan = sched.schedule()
        rows += [(r.start_pos, len(r.token_ids), r.sample, len(r.kv_pages)) for r in plan.rows]
        sched.apply(plan, engine.execute(plan))
    assert rows == [(0, 8, False, 2), (8, 8, False, 4), (16, 8, False, 6), (24, 6, True, 8),
                    (30, 1, True, 8), (31, 1, True, 8)]


def test_running_sequences_come_first_then_waiting_ones_fill_the_budget() -> None:
    sched = make(64, page_tokens=4, max_batched_tokens=5)
    engine = FakeEngine(sched)
    engine.add(request("a", [1, 2, 3], 4))
    engine.add(request("b", list(range(10)), 2))
    plan = sched.schedule()
    assert [(r.request_id, len(r.token_ids), r.sample) for r in plan.rows] == [("a", 3, True), ("b", 2, False)]
    sched.apply(plan, engine.execute(plan))
    plan = sched.schedule()
    assert [(r.request_id, len(r.token_ids), r.sample) for r in plan.rows] == [("a", 1, True), ("b", 4, False)]
    sched.apply(plan, engine.execute(plan))


def test_max_num_seqs_bounds_the_batch_and_admission_is_in_arrival_order() -> None:
    sched = make(200, max_num_seqs=2)
    engine = FakeEngine(sched)
    for i in range(5):
        engine.add(request(f"r{i}", [i + 1] * 3, 4 + i))
    admitted: list[str] = []
    while sched.has_work():
        plan = sched.schedule()
        assert len(sched.running) <= 2
        admitted += [r.request_id for r in plan.rows if r.request_id not in admitted]
        sched.apply(plan, engine.execute(plan))
    assert admitted == [f"r{i}" for i in range(5)]
    assert_drained(sched)


def test_head_of_queue_is_not_overtaken() -> None:
    # r0 holds most of the pool; r1 cannot fit yet, r2 could, but must wait behind r1.
    sched = make(10, page_tokens=4)
    engine = FakeEngine(sched)
    engine.add(request("r0", [1] * 28, 4))  # 7 pages to prefill
    engine.add(request("r1", [2] * 16, 4))  # 4 pages: only 3 are free
    engine.add(request("r2", [3] * 2, 2))  # 1 page would fit
    plan = sched.schedule()
    assert [r.request_id for r in plan.rows] == ["r0"]
    sched.apply(plan, engine.execute(plan))
    engine.run()
    order = [engine.first_step[r] for r in ("r0", "r1", "r2")]
    assert order == sorted(order) and order[1] > 0


def test_eos_and_stop_tokens_end_a_request() -> None:
    def token_fn(adapter, seed, context):  # 7, 7, EOS, 9, 7, 7, ...
        return [7, 7, EOS, 9][len(context) - 3] if len(context) - 3 < 4 else 7

    cases = [
        (request("eos", [1, 1, 1], 10, ignore_eos=False), [7, 7, EOS], "stop"),
        (request("ign", [1, 1, 1], 6, ignore_eos=True), [7, 7, EOS, 9, 7, 7], "length"),
        (request("stp", [1, 1, 1], 10, ignore_eos=True, stop=frozenset({9})), [7, 7, EOS, 9], "stop"),
        (request("max", [1, 1, 1], 2, ignore_eos=False), [7, 7], "length"),
    ]
    sched = make(50)
    engine = FakeEngine(sched, token_fn)
    seqs = [engine.add(req) for req, _, _ in cases]
    engine.run()
    for seq, (req, tokens, reason) in zip(seqs, cases):
        assert (seq.output_ids, seq.finish_reason) == (tokens, reason), req.request_id
        assert reference(req, 4096, token_fn) == (tokens, reason)
    assert_drained(sched)


def test_max_model_len_ends_a_request() -> None:
    sched = make(50, max_model_len=14)
    engine = FakeEngine(sched)
    seq = engine.add(request("r", list(range(10)), 100))
    engine.run()
    assert len(seq.output_ids) == 4 and seq.finish_reason == "length"


def test_abort_frees_pages_at_every_stage() -> None:
    sched = make(40, page_tokens=4, max_batched_tokens=20)
    engine = FakeEngine(sched)
    running = engine.add(request("running", list(range(12)), 20, adapter="cat"))
    inflight = engine.add(request("inflight", list(range(8)), 20))
    keeper = engine.add(request("keeper", list(range(5)), 6, adapter="cat"))
    waiting = engine.add(request("waiting", list(range(30)), 5))
    plan = sched.schedule()
    assert [r.request_id for r in plan.rows] == ["running", "inflight"]
    assert sched.abort("waiting") is waiting and waiting.finish_reason == "cancelled"
    assert waiting not in sched.waiting
    sched.apply(plan, engine.execute(plan))
    assert sched.allocator.usage().by_tag == {KV: 3 + 2, ADAPTER: 3}
    assert sched.abort("running") is running  # between steps
    assert sched.allocator.usage().by_tag == {KV: 2, ADAPTER: 3}
    assert sched.adapters.refs("cat") == 0
    plan = sched.schedule()
    result = engine.execute(plan)
    assert sched.abort("inflight") is inflight  # while its step runs
    finished = sched.apply(plan, result)
    assert inflight not in finished and inflight.finish_reason == "cancelled"
    assert inflight.kv_pages == [] and len(inflight.output_ids) == 1
    engine.run()
    assert keeper.output_ids == reference(keeper.req, 4096)[0]
    assert sched.abort("keeper") is None and sched.abort("nobody") is None
    assert_drained(sched)


def test_duplicate_request_id_raises() -> None:
    sched = make(50)
    engine = FakeEngine(sched)
    engine.add(request("same", [1, 2], 2))
    with pytest.raises(DuplicateRequestError):
        sched.add(request("same", [3, 4], 2))
    plan = sched.schedule()
    sched.apply(plan, engine.execute(plan))
    with pytest.raises(DuplicateRequestError):
        sched.add(request("same", [3, 4], 2))
    engine.run()
    engine.add(request("same", [3, 4], 2))  # finished ids may be reused
    engine.run()


def test_requests_that_can_never_fit_raise_capacity_error() -> None:
    sched = make(10, page_tokens=4, max_model_len=100)
    with pytest.raises(CapacityError):
        sched.add(request("kv", [1] * 30, 20))  # 50 tokens: 13 pages
    with pytest.raises(CapacityError):
        sched.add(request("adapter", [1] * 30, 6, adapter="cat"))  # 9 KV + 3 adapter pages
    sched.add(request("fits", [1] * 30, 6, adapter="ada"))  # 9 + 1
    small_ctx = make(10, page_tokens=4, max_model_len=8)
    with pytest.raises(CapacityError):
        small_ctx.add(request("long-prompt", [1] * 41, 1))  # the prompt alone needs 11 pages
    assert not small_ctx.has_work()


def test_schedule_twice_without_apply_raises() -> None:
    sched = make(50)
    FakeEngine(sched).add(request("r", [1, 2, 3], 2))
    assert sched.schedule() is not None
    with pytest.raises(RuntimeError, match="before the previous plan"):
        sched.schedule()


def test_scheduler_config_validates() -> None:
    for bad in (dict(max_num_seqs=0), dict(max_batched_tokens=0), dict(max_model_len=-1)):
        with pytest.raises(ValueError):
            SchedulerConfig(**bad)


def test_policy_layer_imports_without_torch() -> None:
    code = ("import sys, loraplex.daemon.memory, loraplex.daemon.memory.adapter_residency, "
            "loraplex.daemon.scheduler.fcfs; assert 'torch' not in sys.modules, 'torch was imported'")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
