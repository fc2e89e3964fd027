"""SLO admission control / early abort (S-LoRA §4.3) under every policy."""
from __future__ import annotations

import dataclasses

import pytest
from test_fcfs_scheduler import assert_drained, reference, request
from test_sched_common import FakeClock, TimedEngine, build, drive

from loraplex.daemon.scheduler.factory import POLICIES
from loraplex.daemon.scheduler.sequence import SeqStatus
from loraplex.ipc.errors import ErrorCode

# With the cost model's prior (5 ms + 0.05 ms/token) a full 32-token step takes 6.6 ms, so the
# k-th 64-token prompt in line (2 steps each) sees its first token after 13.2·k ms.
SLO_S = 0.05


@pytest.mark.parametrize("policy", POLICIES)
def test_requests_predicted_past_the_slo_are_aborted_early(policy) -> None:
    clock = FakeClock()
    sched = build(policy, 1000, clock, max_batched_tokens=32, ttft_slo_s=SLO_S)
    engine = TimedEngine(sched, clock)
    reqs = [request(f"r{i}", [i + 1] * 64, 3) for i in range(10)]
    for req in reqs:
        engine.add(req)
    plan = sched.schedule()
    aborted = sched.take_aborted()
    assert [a.request_id for a in aborted] == [f"r{i}" for i in range(3, 10)]  # 52.8 ms > 50 ms from r3 on
    assert {a.code for a in aborted} == {"overloaded"} and all(ErrorCode(a.code) for a in aborted)
    assert all(a.predicted_ttft_s > SLO_S and "SLO" in a.message for a in aborted)
    assert all(engine.seqs[a.request_id].status is SeqStatus.FINISHED for a in aborted)
    assert {r.request_id for r in plan.rows} <= {"r0", "r1", "r2"}
    sched.apply(plan, engine.execute(plan))
    drive(engine, {})
    for req in reqs[:3]:
        assert engine.seqs[req.request_id].output_ids == reference(req, 4096)[0]
    assert sched.take_aborted() == []
    assert_drained(sched)


def test_a_request_that_already_waited_past_the_slo_times_out() -> None:
    clock = FakeClock()
    sched = build("fcfs", 1000, clock, ttft_slo_s=SLO_S)
    engine = TimedEngine(sched, clock)
    engine.add(request("late", [1] * 4, 2))
    engine.add(request("last", [2] * 4, 2))
    clock.t += 0.2  # both waited 200 ms before the scheduler ran
    plan = sched.schedule()
    aborted = sched.take_aborted()
    # "late" would hold up "last"; "last" starts at once with nobody behind it: aborting it helps nobody.
    assert [(a.request_id, a.code) for a in aborted] == [("late", "timeout")]
    assert [r.request_id for r in plan.rows] == ["last"]
    sched.apply(plan, engine.execute(plan))
    drive(engine, {})
    assert_drained(sched)


def test_an_idle_engine_serves_a_long_request_and_started_requests_are_never_aborted() -> None:
    clock = FakeClock()
    sched = build("fcfs", 1000, clock, max_batched_tokens=32, ttft_slo_s=SLO_S)
    engine = TimedEngine(sched, clock)
    big = engine.add(request("big", [1] * 1000, 2))  # ~200 ms of prefill, but nothing else is waiting
    plan = sched.schedule()
    assert sched.take_aborted() == [] and [r.request_id for r in plan.rows] == ["big"]
    sched.apply(plan, engine.execute(plan))
    drive(engine, {})
    assert big.output_ids == reference(big.req, 4096)[0]
    # A request preempted back to the queue after its first token is never aborted, but still
    # counts as work ahead of the others.
    sched = build("fcfs", 1000, clock, max_batched_tokens=32, max_num_seqs=1, ttft_slo_s=SLO_S)
    engine = TimedEngine(sched, clock)
    started = engine.add(request("started", [1] * 8, 20))
    behind = engine.add(request("behind", [2] * 8, 2))
    plan = sched.schedule()
    assert [r.request_id for r in plan.rows] == ["started"]
    sched.apply(plan, engine.execute(plan))
    sched._preempt(started)  # as if KV ran out
    clock.t += 10.0
    plan = sched.schedule()
    assert [(a.request_id, a.code) for a in sched.take_aborted()] == [("behind", "timeout")]
    assert behind.finish_reason == "timeout" and [r.request_id for r in plan.rows] == ["started"]
    sched.apply(plan, engine.execute(plan))
    drive(engine, {})
    assert started.output_ids == reference(started.req, 4096)[0]
    assert_drained(sched)


def test_a_request_can_bring_its_own_slo() -> None:
    clock = FakeClock()
    sched = build("mlq", 1000, clock, max_batched_tokens=32)  # no scheduler-wide SLO
    engine = TimedEngine(sched, clock)
    reqs = [request(f"r{i}", [i + 1] * 64, 3) for i in range(6)]
    strict = dataclasses.replace(request("strict", [9] * 64, 3), ttft_slo_s=0.03)
    for req in [*reqs, strict]:
        engine.add(req)
    sched.schedule()
    assert [(a.request_id, a.code) for a in sched.take_aborted()] == [("strict", "overloaded")]
    with pytest.raises(ValueError, match="ttft_slo_s"):
        sched.add(dataclasses.replace(request("bad", [1], 1), ttft_slo_s=-1.0))
