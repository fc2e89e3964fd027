"""Routers over engine snapshots: Toppings rank-aware (Fig. 6), the profile file, the
baselines, and dLoRA proactive dispatch and co-migration."""
from __future__ import annotations

import dataclasses
import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loraplex.daemon.router import (
    ROUTERS,
    DloraRouter,
    EngineRequest,
    EngineState,
    KernelCost,
    NoEngineError,
    PerfProfile,
    RequestInfo,
    make_router,
    pending_s,
)


def _fig6() -> list[EngineState]:
    one = EngineState(0, running=tuple(EngineRequest(f"a{i}", f"lora{i % 3}", 32) for i in range(24)))
    two = EngineState(1, running=tuple(EngineRequest(f"b{i}", f"big{i % 2}", 64) for i in range(16)))
    return [one, two]


def test_toppings_fig6_rank64_request_goes_by_kernel() -> None:
    engines = _fig6()
    new = RequestInfo("new", "fresh", rank=64)
    bgmv = make_router("rank_aware", kernel="bgmv", slo_ms=36.0)
    mbgmv = make_router("rank_aware", kernel="mbgmv", slo_ms=36.0)
    # BGMV pads to the batch's max rank: 25·64 on instance 1 vs 17·64 on instance 2.
    assert [round(bgmv.predicted_ms(new, e), 2) for e in engines] == [40.0, 28.48]
    assert bgmv.choose(new, engines) == 1  # instance 2 in the paper's numbering
    # MBGMV sums ranks: 24·32 + 64 vs 16·64 + 64; the same increase on both, instance 2 breaks the SLO.
    assert [round(mbgmv.predicted_ms(new, e), 2) for e in engines] == [28.96, 36.64]
    assert mbgmv.choose(new, engines) == 0  # instance 1
    # Without the SLO in play MBGMV has a tie on the increase and takes the faster batch.
    assert make_router("rank_aware", kernel="mbgmv", slo_ms=100.0).choose(new, engines) == 0
    assert make_router("rank_aware", kernel="bgmv", slo_ms=100.0).choose(new, engines) == 1


def test_rank_aware_prefers_the_batch_whose_padding_is_already_paid() -> None:
    small = EngineState(0, running=(EngineRequest("s", "x", 8),))
    padded = EngineState(1, running=tuple(EngineRequest(f"p{i}", "y", 64) for i in range(4)))
    router = make_router("rank_aware", kernel="bgmv", slo_ms=1e9)
    assert router.choose(RequestInfo("r", "z", rank=64), [small, padded]) == 1  # +64α vs +120α
    assert router.choose(RequestInfo("r", "z", rank=8), [small, padded]) == 0
    assert router.choose(RequestInfo("base", None), [padded, small]) == 1  # no LoRA cost: the faster batch


def test_profile_file_round_trip_and_validation(tmp_path) -> None:
    path = tmp_path / "profile.json"
    profile = PerfProfile(bgmv=KernelCost(0.01, 2.0), mbgmv=KernelCost(0.02, 3.0))
    profile.save(path)
    assert json.loads(path.read_text()) == {"bgmv": {"alpha": 0.01, "beta": 2.0}, "mbgmv": {"alpha": 0.02, "beta": 3.0}}
    assert PerfProfile.load(path) == profile
    assert profile.step_ms("bgmv", [8, 64]) == 0.01 * 2 * 64 + 2.0
    assert profile.step_ms("mbgmv", [8, 64]) == 0.02 * 72 + 3.0
    path.write_text('{"mbgmv": {"alpha": 0.5, "beta": 1}}')
    assert PerfProfile.load(path) == PerfProfile(mbgmv=KernelCost(0.5, 1.0))  # bgmv keeps its default
    fitted = PerfProfile(bgmv=KernelCost(0.01, 2.0, r2=0.97))  # written by bench/decode_profile.py
    fitted.save(path)
    assert json.loads(path.read_text())["bgmv"] == {"alpha": 0.01, "beta": 2.0, "r2": 0.97}
    assert PerfProfile.load(path) == fitted
    for bad in ('{"sgmv": {"alpha": 1, "beta": 1}}', '{"bgmv": {"alpha": 1}}', '{"bgmv": {"alpha": -1, "beta": 0}}',
                '{"bgmv": {"alpha": "1", "beta": 0}}', '{"bgmv": {"alpha": 1, "beta": 0, "r2": 1.5}}',
                '{"bgmv": {"alpha": 1, "beta": 0, "rsq": 1}}', "[1]", "{not json"):
        path.write_text(bad)
        with pytest.raises(ValueError):
            PerfProfile.load(path)
    with pytest.raises(ValueError):
        make_router("rank_aware", kernel="sgmv")


def test_baseline_routers() -> None:
    busy = EngineState(0, running=tuple(EngineRequest(f"r{i}", None, remaining_tokens=100) for i in range(4)),
                       max_num_seqs=4)
    idle = EngineState(1, running=(EngineRequest("x", None, remaining_tokens=10),), max_num_seqs=4)
    dead = EngineState(2, healthy=False)
    new = RequestInfo("n", None, prompt_len=10, max_tokens=10)
    assert make_router("first_fit").choose(new, [busy, idle, dead]) == 1  # busy has no free seat
    assert make_router("first_fit").choose(new, [idle, busy]) == 0
    assert make_router("most_idle").choose(new, [busy, dead, idle]) == 2
    picks = {make_router("random", seed=s).choose(new, [dead, busy, idle]) for s in range(20)}
    assert picks == {1, 2}
    router = make_router("random", seed=7)
    assert [router.choose(new, [busy, idle]) for _ in range(5)] == \
        [r.choose(new, [busy, idle]) for r in [make_router("random", seed=7)] for _ in range(5)]
    for name in ROUTERS:
        with pytest.raises(NoEngineError):
            make_router(name).choose(new, [dead])
        assert make_router(name).rebalance([busy, idle]) == [] or name == "dlora"
    with pytest.raises(ValueError, match="unknown router"):
        make_router("round_robin")


def test_dlora_dispatch_counts_the_adapter_load() -> None:
    link = 1e9  # bytes/s
    holder = EngineState(0, waiting=(EngineRequest("q", None, remaining_tokens=200),), tokens_per_s=1000,
                         resident_adapters=frozenset({"ada"}), load_bytes_per_s=link)
    empty = EngineState(1, tokens_per_s=1000, load_bytes_per_s=link)
    small = RequestInfo("r", "ada", prompt_len=50, max_tokens=50, adapter_bytes=int(0.1 * link))
    big = RequestInfo("r", "ada", prompt_len=50, max_tokens=50, adapter_bytes=int(0.3 * link))
    router = make_router("dlora")
    assert router.finish_s(small, empty) == pytest.approx(0.1 + 0.1)
    assert router.finish_s(small, holder) == pytest.approx(0.2 + 0.1)
    assert router.choose(small, [holder, empty]) == 1  # 0.2 s with a 0.1 s load beats 0.3 s of queue
    assert router.choose(big, [holder, empty]) == 0  # a 0.3 s load does not


def test_dlora_rebalance_moves_queued_requests_with_their_adapter() -> None:
    hot = EngineState(0, running=(EngineRequest("run", "ada", remaining_tokens=50),),
                      waiting=tuple(EngineRequest(f"a{i}", "ada", remaining_tokens=100, adapter_bytes=10**6)
                                    for i in range(6))
                      + tuple(EngineRequest(f"b{i}", "bob", remaining_tokens=100, adapter_bytes=10**6)
                              for i in range(2)),
                      resident_adapters=frozenset({"ada", "bob"}), tokens_per_s=1000, load_bytes_per_s=1e9)
    cold = EngineState(1, resident_adapters=frozenset({"bob"}), tokens_per_s=1000, load_bytes_per_s=1e9)
    moves = DloraRouter(imbalance=0.1).rebalance([hot, cold])
    assert moves, "an 850-token vs 0-token imbalance must move something"
    moved = [rid for m in moves for rid in m.request_ids]
    assert "run" not in moved and len(moved) == len(set(moved))
    for m in moves:
        assert (m.source, m.target) == (0, 1)
        assert m.load_adapter == (m.adapter == "ada") or m.adapter == "bob" and not m.load_adapter
    after_hot = pending_s(hot) - sum(m.moved_tokens for m in moves) / 1000
    assert abs(after_hot - sum(m.moved_tokens for m in moves) / 1000) < pending_s(hot) / 4
    balanced = [EngineState(i, waiting=(EngineRequest(f"r{i}", "x", remaining_tokens=100),)) for i in range(3)]
    assert DloraRouter().rebalance(balanced) == []


@st.composite
def clusters(draw):
    engines = []
    for e in range(draw(st.integers(1, 4))):
        waiting = tuple(EngineRequest(f"e{e}w{i}", draw(st.sampled_from([None, "a", "b", "c"])),
                                      remaining_tokens=draw(st.integers(1, 400)),
                                      adapter_bytes=draw(st.integers(0, 10**6)))
                        for i in range(draw(st.integers(0, 8))))
        running = tuple(EngineRequest(f"e{e}r{i}", "a", remaining_tokens=draw(st.integers(1, 400)))
                        for i in range(draw(st.integers(0, 3))))
        engines.append(EngineState(e, running=running, waiting=waiting,
                                   resident_adapters=frozenset(draw(st.sets(st.sampled_from(["a", "b", "c"])))),
                                   tokens_per_s=draw(st.sampled_from([500.0, 1000.0, 2000.0])),
                                   load_bytes_per_s=draw(st.sampled_from([0.0, 1e7, 1e9])),
                                   healthy=draw(st.booleans()) or e == 0))
    return engines


@settings(max_examples=150, deadline=None)
@given(clusters(), st.floats(0, 1))
def test_dlora_rebalance_is_sound(engines, imbalance) -> None:
    moves = DloraRouter(imbalance=imbalance).rebalance(engines)
    seen: set[str] = set()
    for m in moves:
        src = engines[m.source]
        queued = {r.request_id: r for r in src.waiting}
        assert m.source != m.target and engines[m.source].healthy and engines[m.target].healthy
        assert set(m.request_ids) <= set(queued), "only queued requests of the source move"
        assert all(queued[rid].adapter == m.adapter for rid in m.request_ids)
        assert not seen & set(m.request_ids)
        seen |= set(m.request_ids)
        assert m.moved_tokens == sum(queued[rid].remaining_tokens for rid in m.request_ids)
    # Carried out, the migrations leave the busiest engine no busier than before.
    out = {rid for m in moves for rid in m.request_ids}
    after = []
    for i, e in enumerate(engines):
        if not e.healthy:
            after.append(0.0)
            continue
        moved_in = tuple(r for m in moves if m.target == i for r in engines[m.source].waiting
                         if r.request_id in m.request_ids)
        waiting = tuple(r for r in e.waiting if r.request_id not in out) + moved_in
        after.append(pending_s(dataclasses.replace(e, waiting=waiting)))
    before = max(pending_s(e) for e in engines if e.healthy)
    assert max(after) <= before + 1e-9
    if moves:
        assert after[moves[0].source] < pending_s(engines[moves[0].source])


def test_rank_aware_adds_the_step_time_its_model_does_not_explain() -> None:
    profile = PerfProfile(mbgmv=KernelCost(0.1, 4.0))
    router = make_router("rank_aware", profile=profile, kernel="mbgmv", slo_ms=20.0)
    batch = tuple(EngineRequest(f"r{i}", "a", rank=16) for i in range(4))  # predicted 0.1*64 + 4 = 10.4 ms
    # Both engines' recent steps averaged 64 rank units; on `slow` they took 5.2 ms longer than
    # the model says (prefill chunks sharing its steps).
    calm = EngineState(0, running=batch, step_ms=10.4, step_mbgmv_units=64.0)
    slow = EngineState(1, running=batch, step_ms=15.6, step_mbgmv_units=64.0)
    new = RequestInfo("x", "b", rank=32)
    assert router.unmodelled_ms(calm) == 0.0 and math.isclose(router.unmodelled_ms(slow), 5.2)
    assert router.unmodelled_ms(EngineState(2)) == 0.0  # nothing observed yet
    assert router.unmodelled_ms(EngineState(3, running=batch, step_ms=5.0, step_mbgmv_units=64.0)) == 0.0
    # The observed steps ran a smaller batch (32 units: 7.2 ms predicted) in 12.4 ms: 5.2 ms unexplained.
    shrunk = EngineState(4, running=batch, step_ms=12.4, step_mbgmv_units=32.0)
    assert math.isclose(router.unmodelled_ms(shrunk), 5.2)
    # By the model alone both fit the SLO (13.6 ms); with what it leaves out, the slow one would miss it.
    assert math.isclose(router.predicted_ms(new, slow), 13.6 + 5.2)
    assert router.choose(new, [slow, calm]) == 1
    tight = make_router("rank_aware", profile=profile, kernel="mbgmv", slo_ms=18.0)
    assert tight.choose(new, [slow, calm]) == 1 and tight.cost(new, slow) > 1000.0


def _spread_engines(std: float) -> list[EngineState]:
    # BGMV α=0.05, β=4. A: four rank-64 rows (16.8 ms; a rank-64 newcomer makes 20.0 ms, +3.2);
    # B: two rank-8 rows (4.8 ms; the newcomer pads them to 64: 13.6 ms, +8.8).
    a = EngineState(0, running=tuple(EngineRequest(f"a{i}", "big", 64, remaining_tokens=100) for i in range(4)),
                    step_ms_std=std)
    b = EngineState(1, running=tuple(EngineRequest(f"b{i}", "small", 8, remaining_tokens=100) for i in range(2)),
                    step_ms_std=std)
    return [a, b]


def test_rank_aware_leaves_short_requests_headroom_for_step_time_spread() -> None:
    profile = PerfProfile(bgmv=KernelCost(0.05, 4.0))
    router = make_router("rank_aware", profile=profile, kernel="bgmv", slo_ms=22.0)
    long_one = RequestInfo("long", "big2", rank=64, max_tokens=500)
    short_one = RequestInfo("short", "big2", rank=64, max_tokens=8)
    # Steps scatter by σ = 4 ms: on A (20 ms, 2 ms under the SLO) the mean of 8 steps misses
    # when 20 + 2·4/√8 > 22; 500 steps average the scatter out. B keeps 8.4 ms of headroom.
    spread = _spread_engines(4.0)
    assert router.violations(short_one, spread[0], 20.0) == 1 and router.violations(long_one, spread[0], 20.0) == 0
    assert router.choose(long_one, spread) == 0  # the cheaper engine: +3.2 ms
    assert router.choose(short_one, spread) == 1
    # Nothing observed (σ = 0) or a router without the margin: the plain SLO check, both fit on A.
    assert router.choose(short_one, _spread_engines(0.0)) == 0
    plain = make_router("rank_aware", profile=profile, kernel="bgmv", slo_ms=22.0, spread_k=0.0)
    assert plain.choose(short_one, spread) == 0
    with pytest.raises(ValueError):
        make_router("rank_aware", spread_k=-1.0)


def test_rank_aware_charges_only_the_slo_misses_a_placement_causes() -> None:
    profile = PerfProfile(bgmv=KernelCost(0.05, 4.0))
    router = make_router("rank_aware", profile=profile, kernel="bgmv", slo_ms=22.0)
    a, b = _spread_engines(4.0)
    # A request with 2 tokens left already misses at A's 16.8 ms (16.8 + 8/√2 > 22): placing
    # another request there does not make it miss, so it does not count against A.
    nearly_done = EngineRequest("done-soon", "big", 64, remaining_tokens=2)
    a = dataclasses.replace(a, running=(*a.running[:3], nearly_done))
    assert router.violations(None, a, 16.8) == 1
    long_one = RequestInfo("long", "big2", rank=64, max_tokens=500)
    assert math.isclose(router.cost(long_one, a), 3.2)
    assert router.choose(long_one, [a, b]) == 0


def test_step_times_follow_the_level_and_measure_the_spread() -> None:
    import random

    from loraplex.daemon.router.snapshot import StepTimes

    steady = StepTimes()
    for _ in range(50):
        steady.observe(12.5)
    assert steady.mean_ms == 12.5 and steady.std_ms == 0.0
    # Decode steps of 20 ms, one in five carrying a 25 ms prefill chunk: σ = 25·√(0.2·0.8) = 10 ms.
    rng = random.Random(7)
    spiky = StepTimes()
    for _ in range(4000):
        spiky.observe(20.0 + (25.0 if rng.random() < 0.2 else 0.0))
    assert 7.0 < spiky.std_ms < 13.0
    assert 20.0 <= spiky.mean_ms <= 45.0
    level = StepTimes()
    level.observe(10.0)
    for _ in range(30):
        level.observe(30.0)
    assert level.mean_ms > 29.0  # follows a new level within a few steps


def test_step_times_average_the_lora_work_of_the_same_steps() -> None:
    from loraplex.daemon.router.snapshot import StepTimes

    steps = StepTimes()
    steps.observe(10.0, [8, 64, 16])
    assert (steps.bgmv_units, steps.mbgmv_units) == (3 * 64, 88)
    for _ in range(60):
        steps.observe(10.0, [32, 32])
    assert math.isclose(steps.bgmv_units, 64.0, rel_tol=1e-3) and math.isclose(steps.mbgmv_units, 64.0, rel_tol=1e-3)
    steps.observe(10.0, [])  # a base-model step: no LoRA work
    assert steps.bgmv_units < 64.0


def test_rank_aware_counts_the_slack_or_debt_a_running_request_already_has() -> None:
    # TPT is the mean of all of a request's steps: 100 steps done and 100 to go, SLO 22 ms.
    profile = PerfProfile(bgmv=KernelCost(0.05, 4.0))
    router = make_router("rank_aware", profile=profile, kernel="bgmv", slo_ms=22.0, spread_k=0.0)
    ahead = EngineRequest("ahead", "big", 64, remaining_tokens=100, decoded_steps=100, decode_ms=1800.0)  # 18 ms so far
    behind = EngineRequest("behind", "big", 64, remaining_tokens=100, decoded_steps=100, decode_ms=2500.0)  # 25 ms
    engine = EngineState(0, running=(ahead, behind))
    # Steps of 23 ms break the SLO for a fresh request, but `ahead` ends at (1800 + 2300)/200 = 20.5 ms;
    # steps of 21 ms are within it, but `behind` ends at (2500 + 2100)/200 = 23 ms.
    assert router.violations(None, dataclasses.replace(engine, running=(ahead,)), 23.0) == 0
    assert router.violations(None, dataclasses.replace(engine, running=(behind,)), 21.0) == 1
    assert router.violations(None, dataclasses.replace(engine, running=(behind,)), 18.9) == 0  # (2500+1890)/200 < 22
    # Without history both are judged by the step alone.
    fresh = tuple(dataclasses.replace(r, decoded_steps=0, decode_ms=0.0) for r in (ahead, behind))
    assert router.violations(None, dataclasses.replace(engine, running=fresh), 23.0) == 2


def test_rank_aware_charges_a_long_prompt_to_the_requests_whose_steps_it_slows() -> None:
    # Both engines run two rank-64 requests; with a rank-64 newcomer a step takes 13.6 ms, 2.4 ms
    # under the SLO. On A they have 10 tokens left, on B 400. A 1,000-token prompt at 0.1 ms a
    # token puts 100 ms on one step of each: +10 ms per token on A (misses), +0.25 on B (fits).
    profile = PerfProfile(bgmv=KernelCost(0.05, 4.0))
    router = make_router("rank_aware", profile=profile, kernel="bgmv", slo_ms=16.0, spread_k=0.0)

    def engine(i: int, left: int) -> EngineState:
        return EngineState(i, running=tuple(EngineRequest(f"{i}-{k}", "big", 64, remaining_tokens=left)
                                            for k in range(2)), prefill_ms_per_token=0.1)

    near_done, long_lived = engine(0, 10), engine(1, 400)
    long_prompt = RequestInfo("p", "big", rank=64, prompt_len=1000, max_tokens=50)
    short_prompt = dataclasses.replace(long_prompt, prompt_len=10)
    assert router.cost(long_prompt, near_done) > 1000.0 and router.cost(long_prompt, long_lived) < 10.0
    assert router.choose(long_prompt, [near_done, long_lived]) == 1
    assert router.cost(short_prompt, near_done) == router.cost(short_prompt, long_lived) < 10.0
    # An engine whose prefill cost is unknown (nothing observed) charges nothing for it.
    assert router.cost(long_prompt, dataclasses.replace(near_done, prefill_ms_per_token=0.0)) < 10.0


def test_step_times_learn_what_a_prefill_token_adds_to_a_step() -> None:
    import random

    from loraplex.daemon.router.snapshot import StepTimes

    rng = random.Random(3)
    steps = StepTimes()
    assert steps.ms_per_prefill_token == 0.0
    for _ in range(3000):
        extra = rng.choice((0, 0, 0, 0, 50, 300, 900))
        steps.observe(20.0 + 0.08 * extra + rng.gauss(0.0, 1.0), [16], extra)
    assert 0.07 < steps.ms_per_prefill_token < 0.09
    decode_only = StepTimes()
    for _ in range(200):
        decode_only.observe(20.0 + rng.gauss(0.0, 1.0), [16], 0)
    assert decode_only.ms_per_prefill_token == 0.0  # no prefill seen: no slope to fit


def test_engine_snapshot_carries_each_running_request_tpt_so_far() -> None:
    from loraplex.contracts.geometry import PageGeometry
    from loraplex.daemon.memory.allocator import PageAllocator
    from loraplex.daemon.router.snapshot import engine_state
    from loraplex.daemon.scheduler.config import SchedulerConfig
    from loraplex.daemon.scheduler.factory import make_scheduler
    from loraplex.daemon.scheduler.sequence import SeqRequest
    from loraplex.ipc.engine_plan import SamplingSpec

    sched = make_scheduler("fcfs", SchedulerConfig(max_num_seqs=4, max_batched_tokens=64, max_model_len=128,
                                                   max_loras_per_batch=0, admit_when_loaded=False),
                           PageGeometry(kv_dim=1, page_tokens=4, max_row_width=0), PageAllocator(64), lambda _: 1)
    sched.add(SeqRequest(request_id="r", prompt_ids=[1, 2, 3], adapter=None, sampling=SamplingSpec(temperature=0.0),
                         max_tokens=20, ignore_eos=True))
    sched.add(SeqRequest(request_id="q", prompt_ids=[1, 2, 3], adapter=None, sampling=SamplingSpec(temperature=0.0),
                         max_tokens=20, ignore_eos=True))
    seq = sched.running[0] if sched.running else sched.waiting[0]
    seq.first_token_at, seq.output_ids = 100.0, [7, 7, 7, 7, 7]  # 4 decode steps since the first token

    def snap(now):
        return engine_state(0, sched, rank_of=lambda _: 0, bytes_of=lambda *_: 0, max_num_seqs=4, total_pages=64,
                            tokens_per_s=1.0, load_bytes_per_s=0.0, now=now)

    views = {r.request_id: r for r in (*snap(100.1).running, *snap(100.1).waiting)}
    assert views["r"].decoded_steps == 4 and math.isclose(views["r"].decode_ms, 100.0)
    assert views["q"].decoded_steps == 0 and views["q"].decode_ms == 0.0  # not decoding yet
    assert all(r.decoded_steps == 0 for r in (*snap(None).running, *snap(None).waiting))
