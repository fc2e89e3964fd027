"""bench/cache_policies.py runs end to end, tiny, and prints well-formed JSON.

Shapes and sanity only: benchmarks are never timed in tests (DESIGN §7)."""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "cache_policies.py"
POLICIES = ("none", "lru", "fifo", "cost")


def run(*args: str) -> dict[str, Any]:
    proc = subprocess.run([sys.executable, str(SCRIPT), "--json", "--requests", "120", "--adapters", "20",
                           "--seeds", "2", *args], capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)  # the whole of stdout is one JSON object


def finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


@pytest.fixture(scope="module")
def report() -> dict[str, Any]:
    return run("--rates", "0.5", "2")


def test_report_shape(report: dict[str, Any]) -> None:
    assert report["benchmark"] == "cache_policies"
    config = report["config"]
    assert config["zipf_exponent"] == 1.0 and config["adapters"] == 20 and config["seeds"] == [0, 1]
    assert config["cost_weights"] == {"frequency": 0.45, "recency": 0.10, "size": 0.45, "half_life_s": 60.0}
    assert [r["rate_rps"] for r in report["results"]] == [0.5, 2.0]
    for row in report["results"]:
        assert tuple(row["policies"]) == POLICIES
        assert set(row["cost_p99_over"]) == {"none", "lru", "fifo"}
        for r in row["policies"].values():
            assert 0.0 <= r["hit_rate"] <= 1.0
            t = r["ttft_ms"]
            assert all(finite(t[k]) and t[k] > 0 for k in ("p50", "p90", "p99", "mean"))
            assert t["p50"] <= t["p90"] <= t["p99"]
            assert len(r["ttft_p99_ms_by_seed"]) == 2
            assert 0.0 <= r["link_busy"] <= 1.0 and r["loads"] >= 1 and r["pages_loaded"] >= r["loads"]
    targets = report["targets"]
    assert len(targets["cost_p99_le_lru_per_rate"]) == 2
    assert isinstance(targets["cost_p99_le_half_none_at_highest_rate"], bool)


def test_a_cache_beats_no_cache_on_hits(report: dict[str, Any]) -> None:
    """With 20 adapters the pool holds them all: every caching policy hits far more than none."""
    for row in report["results"]:
        p = row["policies"]
        for name in ("lru", "fifo", "cost"):
            assert p[name]["hit_rate"] > p["none"]["hit_rate"]
            assert p[name]["pages_loaded"] < p["none"]["pages_loaded"]


def test_synthetic_lengths_when_the_trace_is_missing(tmp_path: Path) -> None:
    report = run("--rates", "1", "--policies", "lru", "cost", "--trace", str(tmp_path / "missing.csv"),
                 "--no-prefetch", "--stall", "row")
    assert report["config"]["lengths"] == "synthetic"
    assert report["config"]["server_model"]["prefetch"] is False
    assert report["targets"]["cost_p99_le_half_none_at_highest_rate"] is None
    (row,) = report["results"]
    assert tuple(row["policies"]) == ("lru", "cost")
    assert row["policies"]["lru"]["prefetches"] == 0
