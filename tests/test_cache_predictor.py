"""The inter-arrival histogram predictor: conditional probability of a request within the
horizon, sliding window, bounded history."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loraplex.daemon.cache.predictor import ArrivalPredictor, PredictorConfig


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
