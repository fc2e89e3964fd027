"""The simulator's workload generator: reproducible, the rates and popularity asked for,
and trace replay that keeps the file's lengths and time order."""
from __future__ import annotations

import csv
import statistics
from collections import Counter

import pytest

from loraplex.daemon.sim.workload import WorkloadSpec, adapter_ranks, generate, read_trace, trace_path

CONV = trace_path("conv")
needs_trace = pytest.mark.skipif(not CONV.is_file(), reason="shared/traces not present")


def test_same_spec_same_events_and_seed_changes_them() -> None:
    spec = WorkloadSpec(seed=3, duration_s=30, rate_rps=5)
    assert generate(spec) == generate(spec)
    assert generate(spec) != generate(WorkloadSpec(seed=4, duration_s=30, rate_rps=5))


@pytest.mark.parametrize("arrival,cv", [("poisson", 1.0), ("gamma", 0.5), ("gamma", 3.0)])
def test_arrival_rate_and_burstiness(arrival: str, cv: float) -> None:
    events = generate(WorkloadSpec(arrival=arrival, cv=cv, rate_rps=20, duration_s=500, seed=1))
    assert len(events) == pytest.approx(20 * 500, rel=0.1)
    gaps = [b.arrival_s - a.arrival_s for a, b in zip(events, events[1:])]
    assert min(gaps) >= 0 and events[-1].arrival_s < 500
    assert statistics.pstdev(gaps) / statistics.fmean(gaps) == pytest.approx(cv, rel=0.15)


def test_zipf_popularity_is_ordered_and_ranks_from_the_mix() -> None:
    spec = WorkloadSpec(num_adapters=20, zipf_exponent=1.2, rate_rps=50, duration_s=400, ranks=(8, 64))
    events = generate(spec)
    counts = Counter(e.adapter for e in events)
    top = [counts[f"lora{i:04d}"] for i in range(5)]
    assert top == sorted(top, reverse=True)
    assert top[0] / top[1] == pytest.approx(2 ** 1.2, rel=0.15)
    ranks = adapter_ranks(spec)
    assert set(ranks.values()) <= {8, 64}
    assert all(e.rank == ranks[e.adapter] for e in events)


def test_base_fraction_and_length_caps() -> None:
    events = generate(WorkloadSpec(base_fraction=0.3, duration_s=200, rate_rps=20, max_prompt=300, max_output=50))
    base = [e for e in events if e.adapter is None]
    assert len(base) / len(events) == pytest.approx(0.3, abs=0.05)
    assert all(e.rank == 0 for e in base)
    assert all(1 <= e.prompt_len <= 300 and 1 <= e.output_len <= 50 for e in events)


def test_max_requests_and_validation() -> None:
    assert len(generate(WorkloadSpec(max_requests=7, duration_s=1e6))) == 7
    with pytest.raises(ValueError):
        WorkloadSpec(arrival="uniform")
    with pytest.raises(ValueError):
        WorkloadSpec(rank_weights=(1.0,))


@needs_trace
def test_trace_replay_keeps_the_files_lengths_and_rebased_times() -> None:
    with CONV.open(newline="") as f:
        rows = [(int(r["ContextTokens"]), int(r["GeneratedTokens"])) for _, r in zip(range(200), csv.DictReader(f))]
    spec = WorkloadSpec(arrival="trace", lengths="trace", max_requests=200, duration_s=1e9,
                        max_prompt=10**6, max_output=10**6)
    events = generate(spec)
    assert [(e.prompt_len, e.output_len) for e in events] == rows
    assert events[0].arrival_s == 0.0
    times = [t for t, _, _ in read_trace(CONV)[:200]]
    assert [e.arrival_s for e in events] == pytest.approx(times)
    fast = generate(WorkloadSpec(arrival="trace", lengths="trace", max_requests=200, duration_s=1e9, time_scale=4.0))
    assert [e.arrival_s for e in fast] == pytest.approx([t / 4 for t in times])


@needs_trace
def test_trace_duration_limits_replay() -> None:
    events = generate(WorkloadSpec(arrival="trace", lengths="trace", duration_s=60))
    assert events and all(e.arrival_s < 60 for e in events)
    assert len(events) == sum(1 for t, _, _ in read_trace(CONV) if t < 60)
