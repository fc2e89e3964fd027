"""Every scheduling policy against the paged fake engine of test_fcfs_scheduler, on a fake
clock: the same reference tokens whatever the policy, arrivals over time, clustering
and adapter limits; plus the policy factory and the torch-free import rule.

Also the driver the other test_sched_* files share (TimedEngine, drive).
"""
from __future__ import annotations

import dataclasses
import subprocess
import sys
from typing import Callable

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st
from test_fcfs_scheduler import (
    ADAPTER_PAGES,
    VOCAB,
    FakeEngine,
    assert_drained,
    model_token,
    reference,
    request,
    worst_pages,
)

from loraplex.contracts.geometry import PageGeometry
from loraplex.daemon.memory.allocator import PageAllocator
from loraplex.daemon.scheduler.base import BaseScheduler
from loraplex.daemon.scheduler.config import SchedulerConfig
from loraplex.daemon.scheduler.dlora import DloraConfig, DloraScheduler
from loraplex.daemon.scheduler.factory import POLICIES, make_scheduler
from loraplex.daemon.scheduler.fcfs import FcfsScheduler
from loraplex.daemon.scheduler.mlq import MlqConfig, MlqScheduler
from loraplex.daemon.scheduler.sequence import SeqRequest, SeqStatus, Sequence
from loraplex.ipc.engine_plan import StepPlan, StepResult

RANKS = {"ada": 8, "bob": 16, "cat": 64}


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class TimedEngine(FakeEngine):
    """The paged fake engine on a fake clock: a step takes step_ms(plan) and reports it."""

    def __init__(self, sched: BaseScheduler, clock: FakeClock,
                 step_ms: Callable[[StepPlan], float] = lambda plan: 1.0 + 0.05 * plan.num_tokens) -> None:
        super().__init__(sched, model_token)
        self.clock = clock
        self.step_ms = step_ms
        self.plans: list[StepPlan] = []
        self.arrived: dict[str, int] = {}  # request id -> engine step at which it was added
        self.first_token: dict[str, int] = {}  # request id -> engine step that produced its first token

    def add(self, req: SeqRequest):
        self.arrived[req.request_id] = self.steps
        return super().add(req)

    def execute(self, plan: StepPlan) -> StepResult:
        if plan.merged_adapter is not None:
            assert all(r.adapter == plan.merged_adapter for r in plan.rows), "merged plan with foreign rows"
        result = super().execute(plan)
        ms = self.step_ms(plan)
        self.clock.t += ms / 1e3
        self.plans.append(plan)
        for row in result.rows:
            self.first_token.setdefault(row.request_id, self.steps)
        return dataclasses.replace(result, forward_ms=ms)


def drive(engine: TimedEngine, arrivals: dict[int, list[SeqRequest]], max_steps: int = 20_000) -> None:
    """Add each request when the engine has run `key` steps (jumping ahead when idle); run to the end."""
    sched = engine.sched
    pending = dict(arrivals)
    while pending or sched.has_work():
        due = [k for k in pending if k <= engine.steps]
        if not due and not sched.has_work():
            due = [min(pending)]
        for k in sorted(due):
            for req in pending.pop(k):
                engine.add(req)
        plan = sched.schedule()
        sched.take_aborted()
        if plan is None:
            assert not sched.has_work(), "requests queued but nothing scheduled"
            continue
        sched.apply(plan, engine.execute(plan))
        assert engine.steps < max_steps, "did not finish"


def build(policy: str, num_pages: int, clock: FakeClock, **cfg) -> BaseScheduler:
    page_tokens = cfg.pop("page_tokens", 4)
    options = {k: cfg.pop(k) for k in ("mlq", "dlora") if k in cfg}
    # Mechanism-level scenarios: no adapter limit and no waiting for loads unless a test sets them.
    config = SchedulerConfig(**{"max_num_seqs": 16, "max_batched_tokens": 64, "max_loras_per_batch": 0,
                                "admit_when_loaded": False, **cfg})
    geometry = PageGeometry(kv_dim=2, page_tokens=page_tokens, max_row_width=0)
    return make_scheduler(policy, config, geometry, PageAllocator(num_pages), ADAPTER_PAGES.__getitem__, (2,),
                          adapter_rank=RANKS.__getitem__, clock=clock, **options)


@st.composite
def timed_workloads(draw):
    page_tokens = draw(st.sampled_from([1, 2, 4]))
    max_model_len = draw(st.integers(8, 48))
    reqs: dict[int, list[SeqRequest]] = {}
    for i in range(draw(st.integers(1, 10))):
        prompt = draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=min(20, max_model_len - 1)))
        req = request(f"r{i}", prompt, draw(st.integers(1, 12)), draw(st.sampled_from([None, *ADAPTER_PAGES])),
                      seed=draw(st.integers(0, 3)), ignore_eos=draw(st.booleans()))
        reqs.setdefault(draw(st.integers(0, 12)), []).append(req)
    return dict(page_tokens=page_tokens, max_model_len=max_model_len, reqs=reqs,
                slack=draw(st.sampled_from([0, 1, 4, 50])), max_batched_tokens=draw(st.integers(1, 32)),
                max_num_seqs=draw(st.integers(1, 5)), cluster=draw(st.booleans()),
                max_loras=draw(st.sampled_from([0, 1, 2])))


def build_for(policy: str, w: dict, clock: FakeClock, **cfg) -> BaseScheduler:
    """A scheduler for a timed_workloads() draw: a pool with w["slack"] pages beyond the largest request."""
    geometry = PageGeometry(kv_dim=2, page_tokens=w["page_tokens"], max_row_width=0)
    biggest = max(worst_pages(r, geometry, w["max_model_len"]) for group in w["reqs"].values() for r in group)
    return build(policy, biggest + w["slack"], clock, page_tokens=w["page_tokens"],
                 max_batched_tokens=w["max_batched_tokens"], max_num_seqs=w["max_num_seqs"],
                 max_model_len=w["max_model_len"], cluster_adapters=w["cluster"],
                 max_loras_per_batch=w["max_loras"], mlq=MlqConfig(min_fit_samples=3, refit_every=4), **cfg)


@pytest.mark.parametrize("policy", POLICIES)
@settings(max_examples=60, deadline=None)
@given(w=timed_workloads())
def test_every_policy_gives_the_reference_tokens(policy, w) -> None:
    all_reqs = [r for group in w["reqs"].values() for r in group]
    clock = FakeClock()
    sched = build_for(policy, w, clock, dlora=DloraConfig(min_merge_steps=1, credit_limit_s=0.01))
    engine = TimedEngine(sched, clock)
    drive(engine, w["reqs"])
    event(f"merged steps: {bool([p for p in engine.plans if p.merged_adapter])}")
    for req in all_reqs:
        seq = engine.seqs[req.request_id]
        assert (seq.output_ids, seq.finish_reason) == reference(req, w["max_model_len"]), req.request_id
        assert seq.status is SeqStatus.FINISHED
    if w["max_loras"]:
        for plan in engine.plans:
            assert len({r.adapter for r in plan.rows if r.adapter is not None}) <= w["max_loras"]
    assert_drained(sched)


# All found by the property test (MLQ, a one-token budget, a pool just big enough for the
# largest request, or one page more): one sequence held pages mid-prefill while another,
# served first, took the one token each step, ran out of pages and preempted itself, over
# and over.
LIVELOCKS = {
    "end of prefill": (dict(page_tokens=2, max_model_len=32, max_num_seqs=4), [
        (5, "r0", [12, 0, 36], None, 7, True, 0), (2, "r1", [0], "cat", 5, True, 0),
        (6, "r2", [12, 0, 36], None, 11, True, 0), (9, "r3", [0, 0], None, 7, False, 0),
        (0, "r4", [0], None, 2, True, 0), (0, "r6", [0, 0, 0], None, 1, False, 0),
        (1, "r5", [0] * 14, None, 1, False, 1)]),
    "decoding": (dict(page_tokens=1, max_model_len=34, max_num_seqs=3), [
        (0, "r0", [39, 14, 11, 39, 0, 27, 32, 0, 0, 16, 0], "cat", 9, True, 0),
        (0, "r3", [0, 14, 0, 39, 0, 0, 0, 0, 0, 0, 0], "ada", 10, False, 0),
        (2, "r1", [39, 14, 0, 0, 0, 0, 0, 0, 0, 0, 0], None, 7, False, 0),
        (7, "r2", [0], None, 1, False, 0)]),
    # Seen once in two runs of `make test`: the preempted r2 was let back in because
    # its own resident adapter counted both as pages it keeps and as room for its KV, one page
    # short of what it needed; MLQ served it ahead of r3 (holding the rest mid-prefill), so it
    # ran out again and preempted itself, forever. FCFS and dLoRA finish in 56 steps.
    "own adapter counted twice": (dict(page_tokens=4, max_model_len=30, max_num_seqs=5, slack=1), [
        (0, "r0", [0] * 3, None, 4, False, 0), (0, "r3", [0] * 3, "cat", 8, False, 0),
        (0, "r4", [0] * 5, None, 1, False, 0), (0, "r6", [0], None, 4, False, 0),
        (2, "r2", [0], "ada", 10, False, 0), (2, "r5", [0], None, 1, False, 0),
        (7, "r1", [0] * 14, None, 7, False, 0)]),
}


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("case", sorted(LIVELOCKS))
def test_a_preempted_sequence_does_not_preempt_itself_forever(policy, case) -> None:
    """A preempted sequence now comes back only when all the KV it can still need fits."""
    shape, trace = LIVELOCKS[case]
    arrivals: dict[int, list[SeqRequest]] = {}
    for step, rid, prompt, adapter, max_tokens, ignore_eos, seed in trace:
        arrivals.setdefault(step, []).append(request(rid, prompt, max_tokens, adapter, seed=seed,
                                                     ignore_eos=ignore_eos))
    w = {"slack": 0, **shape, "reqs": arrivals, "max_batched_tokens": 1, "cluster": False, "max_loras": 0}
    clock = FakeClock()
    engine = TimedEngine(build_for(policy, w, clock), clock)
    drive(engine, arrivals, max_steps=2_000)
    for req in (r for group in arrivals.values() for r in group):
        assert (engine.seqs[req.request_id].output_ids,
                engine.seqs[req.request_id].finish_reason) == reference(req, w["max_model_len"])
    assert_drained(engine.sched)


@pytest.mark.parametrize("max_skips, expected", [(8, ["a1", "a2", "n1", "b1", "c1"]),
                                                  (2, ["a1", "a2", "b1", "n1", "c1"])])
def test_clustering_prefers_running_adapters_within_a_skip_bound(max_skips, expected) -> None:
    clock = FakeClock()
    sched = build("fcfs", 200, clock, max_num_seqs=2, cluster_adapters=True, cluster_max_skips=max_skips)
    engine = TimedEngine(sched, clock)
    engine.add(request("first", [1] * 4, 40, "ada"))  # keeps ada running and one of the two seats taken
    sched.apply(plan := sched.schedule(), engine.execute(plan))
    for rid, adapter in [("b1", "bob"), ("a1", "ada"), ("c1", "cat"), ("a2", "ada"), ("n1", None)]:
        engine.add(request(rid, [3] * 4, 1, adapter))  # each finishes in the step it is admitted
    drive(engine, {})
    order = sorted(expected, key=engine.first_token.__getitem__)
    assert order == expected
    # Requests of the running adapter (and base-model ones, which add no LoRA) go first; a request
    # passed over max_skips times goes next regardless.
    assert_drained(sched)


@settings(max_examples=100)
@given(prompt=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=12),
       output=st.lists(st.integers(0, VOCAB - 1), max_size=12), data=st.data())
def test_a_row_feeds_its_slice_of_prompt_and_output(prompt, output, data) -> None:
    """token_slice reads prompt and output without joining them (a decode row used to copy the
    whole prompt every step); it must still be that slice of the two."""
    seq = Sequence(req=request("r", prompt, 20))
    seq.output_ids = list(output)
    tokens = prompt + output
    start = data.draw(st.integers(0, len(tokens)))
    stop = data.draw(st.integers(start, len(tokens)))
    assert seq.token_slice(start, stop) == tokens[start:stop]


def test_factory_builds_each_policy_and_refuses_unknown_names() -> None:
    clock = FakeClock()
    kinds = {"fcfs": FcfsScheduler, "mlq": MlqScheduler, "dlora": DloraScheduler}
    for name in POLICIES:
        sched = build(name, 50, clock)
        assert type(sched) is kinds[name] and sched.policy == name
        assert sched.take_aborted() == [] and sched.merged_adapter is None
    with pytest.raises(ValueError, match="unknown scheduling policy"):
        build("lottery", 50, clock)
    for bad in (dict(max_loras_per_batch=-1), dict(ttft_slo_s=0.0), dict(ttft_slo_s=float("nan")),
                dict(cluster_max_skips=0)):
        with pytest.raises(ValueError):
            SchedulerConfig(**bad)


def test_policies_and_routers_import_without_torch() -> None:
    code = ("import sys, loraplex.daemon.scheduler.factory, loraplex.daemon.scheduler.admission, "
            "loraplex.daemon.router; assert 'torch' not in sys.modules, 'torch was imported'")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
