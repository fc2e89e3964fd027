"""admit_when_loaded: a queued request whose adapter is still being copied waits in the queue
while the batch runs on, instead of stalling every row of the step on the copy.

Driven against the paged fake engine, which here also takes a number of steps to bring each
placed adapter in and reports those still arriving (StepResult.loading), as the real engine does.
"""
from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_fcfs_scheduler import ADAPTER_PAGES, assert_drained, reference, request
from test_sched_common import FakeClock, TimedEngine, build, build_for, drive, timed_workloads

from loraplex.daemon.scheduler.factory import POLICIES
from loraplex.daemon.scheduler.mlq import MlqConfig
from loraplex.daemon.scheduler.sequence import SeqStatus
from loraplex.ipc.engine_plan import StepPlan, StepResult


class ArrivingEngine(TimedEngine):
    """Each placement arrives `load_steps[name]` steps after the plan that placed it; a row of an
    adapter still arriving is allowed (the real engine waits layer by layer) but recorded."""

    def __init__(self, sched, clock, load_steps: dict[str, int]) -> None:
        super().__init__(sched, clock)
        self.load_steps = load_steps
        self.arrives: dict[str, int] = {}  # adapter -> engine step after which it is in
        self.stalled: list[tuple[int, str, bool]] = []  # (step, adapter, other rows were running)
        self.running_before: dict[str, int] = {}  # request -> its preemptions, before the plan
        self.evicted_arriving: list[tuple[int, str, bool]] = []  # (step, adapter, other rows were running)

    def execute(self, plan: StepPlan) -> StepResult:
        # Rows of requests that were running and still hold their KV (one preempted while this
        # plan was made restarts at 0, or where the prefix cache still holds its pages).
        carried = [r for r in plan.rows if r.request_id in self.running_before and r.start_pos > 0
                   and self.seqs[r.request_id].num_preemptions == self.running_before[r.request_id]]
        for name in plan.evict:
            if self.arrives.pop(name, -1) > self.steps:  # evicted while last reported arriving
                self.evicted_arriving.append((self.steps, name, bool(carried)))
        for placement in plan.place:
            self.arrives[placement.name] = self.steps + self.load_steps.get(placement.name, 0)
        carried_adapters = {r.adapter for r in carried}
        for row in plan.rows:
            arriving = row.adapter is not None and self.arrives.get(row.adapter, -1) > self.steps
            if arriving and row.request_id not in self.running_before and row.adapter not in carried_adapters:
                self.stalled.append((self.steps, row.adapter, bool(carried)))
        result = super().execute(plan)
        return dataclasses.replace(result, loading=[n for n, at in self.arrives.items() if at > self.steps])


def _drive(engine: ArrivingEngine, arrivals) -> None:
    sched = engine.sched
    schedule = sched.schedule

    def tracked():
        engine.running_before = {s.request_id: s.num_preemptions for s in sched.running}
        return schedule()

    sched.schedule = tracked
    drive(engine, arrivals)


@pytest.mark.parametrize("policy", POLICIES)
@settings(max_examples=40, deadline=None)
@given(w=timed_workloads(), loads=st.fixed_dictionaries({a: st.integers(0, 4) for a in ADAPTER_PAGES}))
def test_every_policy_still_gives_the_reference_tokens_and_never_stalls_a_running_batch(policy, w, loads) -> None:
    all_reqs = [r for group in w["reqs"].values() for r in group]
    clock = FakeClock()
    sched = build_for(policy, w, clock, admit_when_loaded=True)
    engine = ArrivingEngine(sched, clock, loads)
    _drive(engine, w["reqs"])
    for req in all_reqs:
        seq = engine.seqs[req.request_id]
        assert (seq.output_ids, seq.finish_reason) == reference(req, w["max_model_len"]), req.request_id
        assert seq.status is SeqStatus.FINISHED
    # A request joins the batch with its adapter still arriving only when nothing was running:
    # then there is no one to hold up, and the step overlaps the copy.
    assert not [s for s in engine.stalled if s[2]], engine.stalled
    # Nor is an adapter evicted while its copy is under way (the engine would wait for it).
    assert not [e for e in engine.evicted_arriving if e[2]], engine.evicted_arriving
    assert_drained(sched)


def _two_step_world(policy: str = "fcfs", **cfg):
    clock = FakeClock()
    sched = build(policy, 400, clock, **{"admit_when_loaded": True, **cfg})
    engine = ArrivingEngine(sched, clock, {"ada": 0, "bob": 2, "cat": 2})
    return sched, engine


def _with_ada_running(policy: str = "fcfs", **cfg):
    """A request on `ada` (arrives at once) runs; the next cold adapter takes two steps to arrive."""
    sched, engine = _two_step_world(policy, **cfg)
    engine.add(request("long", [1] * 4, 20, "ada"))
    _step(sched, engine)
    return sched, engine


def _step(sched, engine):
    engine.running_before = {s.request_id: s.num_preemptions for s in sched.running}
    plan = sched.schedule()
    sched.apply(plan, engine.execute(plan))
    return plan


def test_a_cold_request_waits_in_the_queue_while_its_adapter_arrives():
    sched, engine = _with_ada_running()
    engine.add(request("cold", [2] * 4, 2, "bob"))
    plan = _step(sched, engine)
    assert [p.name for p in plan.place] == ["bob"]  # its copy starts with this step...
    assert [r.request_id for r in plan.rows] == ["long"]  # ...which does not wait for it
    assert engine.seqs["cold"].status is SeqStatus.WAITING and engine.seqs["cold"].waited_for_adapter
    plan = _step(sched, engine)  # bob still arriving after this step
    assert "cold" not in {r.request_id for r in plan.rows} and not plan.place
    plan = _step(sched, engine)
    assert "cold" in {r.request_id for r in plan.rows} and not plan.place  # no second copy
    assert sched.adapters.usage("bob").misses == 1 and sched.adapters.usage("bob").hits == 0
    assert sched.adapters.totals.loads == 2


def test_off_the_request_joins_the_step_that_places_its_adapter():
    sched, engine = _with_ada_running(admit_when_loaded=False)
    engine.add(request("cold", [2] * 4, 2, "bob"))
    plan = _step(sched, engine)
    assert [p.name for p in plan.place] == ["bob"] and {"long", "cold"} == {r.request_id for r in plan.rows}
    assert not engine.seqs["cold"].waited_for_adapter


def test_requests_behind_a_loading_head_go_first_when_their_adapter_is_in():
    sched, engine = _with_ada_running()
    engine.add(request("cold", [2] * 4, 2, "bob"))
    engine.add(request("warm", [3] * 4, 2, "ada"))
    engine.add(request("base", [4] * 4, 2, None))
    plan = _step(sched, engine)
    assert {r.request_id for r in plan.rows} == {"long", "warm", "base"}
    assert engine.seqs["cold"].status is SeqStatus.WAITING


def test_a_second_request_for_an_adapter_a_running_request_awaits_is_not_held_back():
    """When the first user of an adapter was admitted alone (overlapping the copy), its rows wait
    for the copy anyway: a second request for the same adapter joins at once."""
    sched, engine = _two_step_world()
    engine.add(request("first", [1] * 4, 20, "bob"))
    plan = _step(sched, engine)
    assert [p.name for p in plan.place] == ["bob"] and [r.request_id for r in plan.rows] == ["first"]
    engine.add(request("second", [2] * 4, 2, "bob"))
    plan = _step(sched, engine)
    assert {r.request_id for r in plan.rows} == {"first", "second"}
    assert not engine.seqs["second"].waited_for_adapter


def test_a_prefetched_adapter_still_arriving_counts_a_miss_for_the_request_that_waits():
    sched, engine = _with_ada_running(max_num_seqs=2)
    engine.add(request("taker", [2] * 4, 20, "ada"))  # takes the last seat: bob's request queues
    engine.add(request("later", [3] * 4, 2, "bob"))
    plan = _step(sched, engine)
    assert "taker" in {r.request_id for r in plan.rows} and "later" not in {r.request_id for r in plan.rows}
    assert [p.name for p in plan.place] == ["bob"]  # prefetched for the queued request
    sched.abort("taker")  # a seat opens
    plan = _step(sched, engine)  # bob still arriving: "later" waits for it
    assert "later" not in {r.request_id for r in plan.rows} and engine.seqs["later"].waited_for_adapter
    while engine.seqs["later"].status is SeqStatus.WAITING:
        _step(sched, engine)
    assert sched.adapters.usage("bob").misses == 1 and sched.adapters.usage("bob").prefetch_hits == 0


def test_mlq_does_not_treat_a_loading_head_as_blocked():
    sched, engine = _with_ada_running("mlq", mlq=MlqConfig(min_fit_samples=3, refit_every=4))
    engine.add(request("cold", [2] * 4, 2, "bob"))
    engine.add(request("warm", [3] * 4, 2, "ada"))
    plan = _step(sched, engine)
    assert "warm" in {r.request_id for r in plan.rows} and "cold" not in {r.request_id for r in plan.rows}


def test_with_nothing_running_loads_still_reported_arriving_do_not_block_the_queue():
    """Arriving adapters are kept from eviction, but only steps report them in: with nothing
    left running, the scheduler stops waiting for them rather than idle with work queued."""
    clock = FakeClock()
    sched = build("fcfs", 5, clock, admit_when_loaded=True)
    engine = ArrivingEngine(sched, clock, {"ada": 0, "bob": 50, "cat": 0})
    engine.add(request("long", [1] * 4, 4, "ada"))
    _step(sched, engine)
    engine.add(request("cold", [2] * 4, 2, "bob"))
    _step(sched, engine)  # bob placed ahead and reported arriving
    assert sched.adapters.arriving == {"bob"}
    sched.abort("long")
    sched.abort("cold")
    engine.add(request("new", [3] * 4, 2, "cat"))  # needs bob's pages
    plan = sched.schedule()
    assert plan is not None and [r.request_id for r in plan.rows] == ["new"]
    assert "bob" in plan.evict


def test_a_request_passes_one_awaiting_its_copy_only_with_a_seat_and_pages_to_spare():
    """Passing must not delay the waiting request once its copy is in: with the last free seat
    held for it, a ready request behind it waits too, and the held one goes first."""
    sched, engine = _with_ada_running(max_num_seqs=2)
    engine.add(request("cold", [2] * 4, 2, "bob"))
    engine.add(request("warm", [3] * 4, 2, "ada"))
    plan = _step(sched, engine)
    assert [r.request_id for r in plan.rows] == ["long"]  # the second seat is held for "cold"
    while engine.seqs["cold"].status is SeqStatus.WAITING:
        _step(sched, engine)
    assert engine.seqs["warm"].status is SeqStatus.WAITING  # "cold" took the held seat


def test_a_request_that_would_take_the_awaiting_ones_pages_waits_behind_them():
    clock = FakeClock()
    sched = build("fcfs", 9, clock, admit_when_loaded=True)  # ada 1 + bob 2 + cat 3 pages
    engine = ArrivingEngine(sched, clock, {"ada": 0, "bob": 2, "cat": 0})
    engine.add(request("long", [1] * 4, 4, "ada"))  # 1 KV page, 2 by its end
    _step(sched, engine)
    engine.add(request("cold", [2] * 8, 2, "bob"))  # bob's 2 pages placed ahead, 2 KV pages held
    engine.add(request("big", [3] * 4, 2, "cat"))  # cat's 3 pages + 1 KV page would leave cold short
    plan = _step(sched, engine)
    assert [r.request_id for r in plan.rows] == ["long"] and [p.name for p in plan.place] == ["bob"]
    assert engine.seqs["big"].status is SeqStatus.WAITING


@pytest.mark.parametrize("policy", POLICIES)
def test_a_pass_planned_again_drops_the_reservations_of_the_pass_it_replaces(policy):
    """A hypothesis example (seed 29): a base request preempts itself for the pages "bob"'s
    copy holds, so the pass is planned again with nothing running. dLoRA kept the first
    pass's page reservation for r1, which then no longer fit beside its own hold: idle with
    four requests queued."""
    w = {"page_tokens": 1, "max_model_len": 8, "slack": 0, "max_batched_tokens": 4, "max_num_seqs": 2,
         "cluster": False, "max_loras": 0,
         "reqs": {0: [request("r0", [0] * 3, 4, ignore_eos=False), request("r2", [0], 1, ignore_eos=False),
                      request("r3", [0], 1, ignore_eos=False)],
                  1: [request(f"r{i}", [0] * n, 1, "bob", ignore_eos=False) for i, n in ((1, 4), (4, 2), (5, 1))]}}
    clock = FakeClock()
    sched = build_for(policy, w, clock, admit_when_loaded=True)
    engine = ArrivingEngine(sched, clock, {"ada": 0, "bob": 2, "cat": 0})
    _drive(engine, w["reqs"])
    for req in (r for group in w["reqs"].values() for r in group):
        assert (engine.seqs[req.request_id].output_ids, engine.seqs[req.request_id].finish_reason) == \
            reference(req, w["max_model_len"]), req.request_id
    assert_drained(sched)
