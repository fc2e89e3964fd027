"""dLoRA dynamic batching: merge/unmerge by thresholds, credit transfer against starvation,
threshold adaptation from measured throughput."""
from __future__ import annotations

import math

import pytest
from test_fcfs_scheduler import assert_drained, reference, request
from test_sched_common import FakeClock, TimedEngine, build, drive

from loraplex.daemon.scheduler.dlora import DloraConfig, DloraScheduler


def _sched(clock: FakeClock, **dlora) -> DloraScheduler:
    sched = build("dlora", 1000, clock, max_num_seqs=32, max_batched_tokens=128, dlora=DloraConfig(**dlora))
    assert isinstance(sched, DloraScheduler)
    return sched


def test_credit_transfer_bounds_how_long_a_left_out_adapter_waits() -> None:
    clock = FakeClock()
    sched = _sched(clock, credit_limit_s=0.018, min_merge_steps=1, adapt=False)
    engine = TimedEngine(sched, clock, step_ms=lambda plan: 4.0)
    ada = [request(f"a{i}", [1 + i] * 4, 40, "ada", seed=i) for i in range(6)]
    for req in ada:
        engine.add(req)
    bob = engine.add(request("bob", [9] * 4, 3, "bob"))
    modes = []
    for step in range(13):
        plan = sched.schedule()
        modes.append(plan.merged_adapter)
        if plan.merged_adapter == "ada":
            assert "bob" not in {r.request_id for r in plan.rows}
        sched.apply(plan, engine.execute(plan))
        if step == 2:  # three merged steps: bob earned 3 x 4 ms, paid by ada (zero-sum transfer)
            assert math.isclose(sched.credits["bob"], 0.012) and math.isclose(sched.credits["ada"], -0.012)
    # 6 of 7 requests are ada's (>= alpha = 0.75): merged; bob's credit passes 18 ms after 5 steps of 4 ms,
    # which forces one unmerged step that serves bob, then ada is merged again.
    assert modes[:12] == ["ada"] * 5 + [None] + ["ada"] * 5 + [None]
    assert [s.reason for s in list(sched.switches)[:3]] == ["threshold", "starvation", "threshold"]
    assert sched.credits["ada"] >= -0.018  # debts are bounded by the limit
    drive(engine, {})
    assert bob.output_ids == reference(bob.req, 4096)[0]
    assert all(engine.seqs[r.request_id].output_ids == reference(r, 4096)[0] for r in ada)
    assert_drained(sched)


def test_merged_adapter_moves_to_the_new_majority_and_unmerges_below_beta() -> None:
    clock = FakeClock()
    sched = _sched(clock, min_merge_steps=2, adapt=False)
    engine = TimedEngine(sched, clock)
    arrivals = {0: [request(f"a{i}", [1] * 4, 30, "ada") for i in range(4)],
                3: [request(f"b{i}", [2] * 4, 30, "bob") for i in range(12)],  # bob 12/16: above alpha
                6: [request(f"c{i}", [3] * 4, 30, "cat") for i in range(12)]}  # bob 12/28: below beta, none >= alpha
    drive(engine, arrivals)
    switches = [(s.old, s.new, s.reason) for s in sched.switches]
    assert switches[:3] == [(None, "ada", "threshold"), ("ada", "bob", "threshold"), ("bob", None, "threshold")]
    assert_drained(sched)


def _episode(merged_ms_per_token: float) -> DloraScheduler:
    """Unmerged steps cost 1 ms + 0.1 ms/token; merged ones the given rate. One merged episode."""
    clock = FakeClock()
    sched = _sched(clock, min_merge_steps=2, adapt=True, adapt_step=0.05)

    def step_ms(plan):
        per_token = 0.1 if plan.merged_adapter is None else merged_ms_per_token
        return 1.0 + per_token * plan.num_tokens

    engine = TimedEngine(sched, clock, step_ms=step_ms)
    drive(engine, {0: [request(f"m{i}", [1] * 8, 6, ["ada", "bob"][i % 2]) for i in range(4)]})  # unmerged
    assert sched.unmerged_tps is not None and not [s for s in sched.switches if s.new is not None]
    drive(engine, {engine.steps: [request(f"a{i}", [2] * 8, 6, "ada") for i in range(8)]})  # merged episode
    drive(engine, {engine.steps: [request("b", [3] * 8, 2, "bob")]})  # ends it ("drained")
    assert [(s.new, s.reason) for s in sched.switches][:2] == [("ada", "threshold"), (None, "drained")]
    assert_drained(sched)
    return sched


@pytest.mark.parametrize("merged_ms_per_token, direction", [(1.0, +1), (0.01, -1)])
def test_alpha_adapts_to_whether_merging_paid(merged_ms_per_token, direction) -> None:
    sched = _episode(merged_ms_per_token)
    assert math.isclose(sched.alpha, 0.75 + direction * 0.05)
    assert sched.beta <= sched.alpha - sched.dlora.threshold_gap


def test_beta_adapts_when_an_episode_ends_by_the_share_rule() -> None:
    for merged_ms_per_token, expected_beta in [(0.01, 0.45), (1.0, 0.55)]:
        clock = FakeClock()
        sched = _sched(clock, min_merge_steps=2, adapt=True, adapt_step=0.05)

        def step_ms(plan, rate=merged_ms_per_token):
            return 1.0 + (0.1 if plan.merged_adapter is None else rate) * plan.num_tokens

        engine = TimedEngine(sched, clock, step_ms=step_ms)
        drive(engine, {0: [request(f"m{i}", [1] * 8, 4, ["ada", "bob"][i % 2]) for i in range(4)]})
        arrivals = {engine.steps: [request(f"a{i}", [2] * 8, 40, "ada") for i in range(4)],
                    engine.steps + 4: [request(f"b{i}", [3] * 8, 4, ["bob", "cat"][i % 2]) for i in range(6)]}
        drive(engine, arrivals)
        ends = [s for s in sched.switches if s.old == "ada"]
        assert ends and ends[0].reason == "threshold"  # ada 4/10 < beta = 0.5
        assert math.isclose(sched.beta, expected_beta), (merged_ms_per_token, sched.beta)
        assert sched.beta <= sched.alpha - sched.dlora.threshold_gap
        assert_drained(sched)


def test_dlora_config_validates() -> None:
    for bad in (dict(merge_threshold=0.5, unmerge_threshold=0.5), dict(merge_threshold=1.5),
                dict(credit_limit_s=0), dict(min_merge_steps=0), dict(threshold_gap=0)):
        with pytest.raises(ValueError):
            DloraConfig(**bad)


def test_merged_adapter_travels_in_the_step_plan() -> None:
    from loraplex.ipc.codec import decode, encode
    from loraplex.ipc.engine_plan import StepPlan
    from loraplex.ipc.protocol import EngineStep

    for merged in ("ada", None):
        msg = EngineStep(plan=StepPlan(step_id=3, rows=[], merged_adapter=merged))
        assert decode(encode(msg)) == msg
