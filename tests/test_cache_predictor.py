"""The inter-arrival histogram predictor: conditional probability of a request within the
horizon, sliding window, bounded history."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loraplex.daemon.gpu_cache.predictor import ArrivalPredictor, PredictorConfig


def beat(pred: ArrivalPredictor, name: str, start: float, period: float, n: int) -> float:
    t = start
    for _ in range(n):
        pred.record(name, t)
        t += period
    return t - period  # the last arrival


def test_a_regular_beat_is_predicted_just_before_it_comes() -> None:
    pred = ArrivalPredictor(PredictorConfig(horizon_s=1.0, bin_s=0.5, min_gaps=3))
    last = beat(pred, "a", 0.0, 4.0, 8)
    assert pred.probability("a", last + 1.0) == 0.0, "the next one is 3 s away"
    assert pred.probability("a", last + 3.5) == 1.0
    assert pred.predict(last + 3.5) == ["a"]
    assert pred.probability("a", last + 10.0) == 0.0, "idle longer than any gap seen"


def test_mixed_gaps_give_the_conditional_probability() -> None:
    pred = ArrivalPredictor(PredictorConfig(horizon_s=1.0, bin_s=1.0, min_gaps=1))
    t = 0.0
    for gap in (1.0, 1.0, 5.0, 5.0):  # gaps centred 1.5 (x2) and 5.5 (x2)
        pred.record("a", t)
        t += gap
    pred.record("a", t)
    assert pred.probability("a", t + 1.0) == pytest.approx(0.5)  # in (1, 2]: 2 of the 4 gaps longer than 1 s
    assert pred.probability("a", t + 2.0) == 0.0  # (2, 3]: none of the 2 survivors
    assert pred.probability("a", t + 4.9) == pytest.approx(1.0)


def test_too_little_history_predicts_nothing() -> None:
    pred = ArrivalPredictor(PredictorConfig(min_gaps=3))
    last = beat(pred, "a", 0.0, 1.0, 3)  # 2 gaps
    assert pred.probability("a", last + 0.9) == 0.0 and pred.predict(last + 0.9) == []
    assert pred.probability("unknown", 0.0) == 0.0


def test_the_window_forgets_old_arrivals() -> None:
    pred = ArrivalPredictor(PredictorConfig(window_s=30.0, horizon_s=1.0, bin_s=0.5, min_gaps=3))
    last = beat(pred, "a", 0.0, 2.0, 10)
    assert pred.probability("a", last + 1.5) == 1.0
    assert pred.probability("a", last + 100.0) == 0.0
    assert pred.predict(last + 100.0) == []
    pred.record("a", last + 200.0)
    assert pred.probability("a", last + 201.0) == 0.0, "the old beat is gone"


def test_predictions_are_ordered_by_probability() -> None:
    pred = ArrivalPredictor(PredictorConfig(horizon_s=1.0, bin_s=0.5, min_gaps=2, threshold=0.3))
    for t in (0.0, 1.0, 2.0, 3.0):
        pred.record("sure", t)  # gaps 1, 1, 1
    for t in (-2.0, -1.0, 2.0, 3.0):
        pred.record("maybe", t)  # gaps 1, 3, 1
    for t in (1.0, 3.0):
        pred.record("thin", t)  # one gap: below min_gaps
    assert pred.probability("sure", 3.6) == 1.0
    assert pred.probability("maybe", 3.6) == pytest.approx(2 / 3)
    assert pred.predict(3.6) == ["sure", "maybe"]
    pred.forget("sure")
    assert pred.predict(3.6) == ["maybe"]


@pytest.mark.parametrize("bad", [dict(window_s=0.0), dict(min_gaps=0), dict(threshold=0.0), dict(max_events=1)])
def test_config_validates(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        PredictorConfig(**bad)  # type: ignore[arg-type]


@settings(max_examples=60, deadline=None)
@given(gaps=st.lists(st.floats(0.0, 50.0), min_size=1, max_size=80), probe=st.floats(0.0, 100.0))
def test_history_stays_bounded_and_probabilities_valid(gaps: list[float], probe: float) -> None:
    config = PredictorConfig(window_s=200.0, max_events=16, min_gaps=1)
    pred = ArrivalPredictor(config)
    t = 0.0
    pred.record("a", t)
    for gap in gaps:
        t += gap
        pred.record("a", t)
        kept = pred._arrivals.get("a")
        assert kept is not None and len(kept) <= config.max_events
        assert sum(pred._gaps["a"].values()) == len(kept) - 1
    p = pred.probability("a", t + probe)
    assert 0.0 <= p <= 1.0


# -- prefetch through AdapterResidency: predictor picks must be in the host store ---------------

class _Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _residency_with_beats(names: list[str], host: set[str] | None):
    import random

    from loraplex.daemon.memory.adapter_residency import AdapterResidency
    from loraplex.daemon.memory.allocator import PageAllocator

    clock = _Clock()
    pred = ArrivalPredictor(PredictorConfig(horizon_s=1.0, bin_s=0.5, min_gaps=3))
    res = AdapterResidency(PageAllocator(64), "lru", predictor=pred, clock=clock,
                           host_resident=None if host is None else host.__contains__)
    period = random.uniform(2.0, 4.0)
    for i in range(8):  # every adapter arrives on the same beat: all are predicted together
        clock.t = i * period
        for n in names:
            res.note_arrival(n)
    clock.t = 7 * period + period - 0.4
    return res


def test_prefetch_skips_predicted_adapters_not_in_the_host_store() -> None:
    import random

    names = [f"a{i}" for i in range(6)]
    on_host = set(random.sample(names, 3))
    res = _residency_with_beats(names, on_host)
    assert set(res._predictor.predict(res._clock())) == set(names), "the predictor does pick all of them"
    queued = next(n for n in names if n not in on_host)  # a queued request's adapter is still prefetched
    placed = res.prefetch([queued], lambda n: 2, budget_pages=64)
    assert {p.name for p in placed} == on_host | {queued}
    assert placed[0].name == queued


def test_without_a_host_filter_every_predicted_adapter_is_prefetched() -> None:
    names = [f"b{i}" for i in range(4)]
    res = _residency_with_beats(names, None)
    placed = res.prefetch([], lambda n: 3, budget_pages=64)
    assert sorted(p.name for p in placed) == names
    # the filter can be bound later (the daemon binds it to its host tier)
    res2 = _residency_with_beats(names, None)
    res2.host_resident = {"b2"}.__contains__
    assert [p.name for p in res2.prefetch([], lambda n: 3, budget_pages=64)] == ["b2"]


def test_engine_slots_build_caches_with_the_configured_predictor_and_host_filter() -> None:
    """scheduler.cache_predictor turns the predictor on in every engine's GPU cache, and each
    cache asks the daemon's host tier (through EngineSlot.host_resident) what sits in the store."""
    import asyncio

    from bench.stub_engine import StubEngineLink
    from loraplex.contracts.geometry import PageGeometry
    from loraplex.daemon.adapter_table import AdapterTable
    from loraplex.daemon.config_load import load_config
    from loraplex.daemon.engine_slot import EngineSlot
    from loraplex.daemon.memory.allocator import PageAllocator

    hello = asyncio.run(StubEngineLink(None, None, {}).start())
    geometry = PageGeometry(kv_dim=1, page_tokens=16, max_row_width=0)
    in_store = {"on-host"}
    for on, horizon in ((False, 5.0), (True, 2.5)):
        config = load_config(None, env={}, overrides={"scheduler.cache_predictor": on,
                                                       "scheduler.cache_predictor_horizon_s": horizon})
        slot = EngineSlot(0, StubEngineLink(None, None, {}), config)
        slot.allocator = PageAllocator(64)
        slot.host_resident = in_store.__contains__
        sched = slot.build_scheduler("fcfs", "lru", geometry, hello, 1, AdapterTable())
        predictor = sched.adapters._predictor
        assert (predictor is not None) == on
        if on:
            assert predictor.config.horizon_s == horizon
        assert sched.adapters.host_resident("on-host") and not sched.adapters.host_resident("on-disk")
