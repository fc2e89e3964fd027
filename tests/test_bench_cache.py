"""bench/cache_policies.py (policy-level replay) and bench/cache_live.py (a real daemon per
policy) run end to end, tiny, and print well-formed JSON.

Shapes and sanity only: benchmarks are never timed in tests."""
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


# -- bench/cache_live.py: live daemons on the CPU demo model --------------------------------------

LIVE = SCRIPT.with_name("cache_live.py")


def test_live_pool_holds_a_working_set_but_not_every_adapter() -> None:
    import random

    sys.path.insert(0, str(LIVE.parent))
    try:
        import cache_live
    finally:
        sys.path.remove(str(LIVE.parent))
    from loraplex.gpu_engine.demo.model import demo_model_config

    ranks = [random.choice((8, 16, 32, 64, 128)) for _ in range(random.randint(24, 40))]
    geometry, pages = cache_live.adapter_pages(demo_model_config(), ranks)
    by_rank = dict(zip(ranks, pages))
    assert all(by_rank[a] < by_rank[b] for a, b in zip(sorted(by_rank), sorted(by_rank)[1:])), by_rank
    num_pages = cache_live.pool_size(geometry, pages, 0.3, 160)
    kv = cache_live.MAX_NUM_SEQS * geometry.kv_pages_for(160)
    assert num_pages - kv < sum(pages), "every adapter would fit: no eviction to measure"
    assert num_pages - kv >= 2 * max(pages)


def test_live_policy_variants_name_a_policy_and_optionally_the_stalling_admission() -> None:
    sys.path.insert(0, str(LIVE.parent))
    try:
        import cache_live
    finally:
        sys.path.remove(str(LIVE.parent))
    assert cache_live.parse_variant("cost") == ("cost", False)
    assert cache_live.parse_variant("none+stall") == ("none", True)
    for bad in ("lfu", "cost+", "cost+fast", "+stall", ""):
        with pytest.raises(ValueError):
            cache_live.parse_variant(bad)
    proc = subprocess.run([sys.executable, str(LIVE), "--policies", "none,cost+slow"], capture_output=True,
                          text=True, timeout=60, check=False)
    assert proc.returncode == 2 and "cost+slow" in proc.stderr


@pytest.mark.parametrize("args, complaint", [
    (["--model", "/nonexistent/model"], "no config.json"),
    (["--throttle-bytes-s", "-1"], "throttle-bytes-s"),
])
def test_live_rejects_a_model_without_config_and_a_negative_throttle(args, complaint) -> None:
    proc = subprocess.run([sys.executable, str(LIVE), *args], capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 2 and complaint in proc.stderr


@pytest.mark.slow  # two daemon start-ups: ~30 s on a busy 2-core host
def test_live_smoke_lru_hits_more_than_none(demo) -> None:
    """Two daemons (none, lru), one light load, a steep Zipf: none frees each adapter when its
    last request ends, lru keeps it, so lru must hit strictly more often. The model is named
    with --model, as on a GPU host, and the link is not throttled."""
    proc = subprocess.run([sys.executable, str(LIVE), "--json", "--policies", "none,lru", "--rates", "6",
                           "--duration", "60", "--max-requests", "14", "--adapters", "6", "--zipf", "2.0",
                           "--model", str(demo.model_dir), "--throttle-bytes-s", "0"],
                          capture_output=True, text=True, timeout=240, check=False)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["benchmark"] == "cache_live"
    assert report["config"]["model"] == str(demo.model_dir) and report["config"]["throttle_bytes_s"] == 0
    assert len(report["config"]["ranks"]) == 6 and set(report["config"]["ranks"].values()) <= {8, 16, 32, 64, 128}
    (row,) = report["results"]
    assert row["rate_rps"] == 6.0 and tuple(row["policies"]) == ("none", "lru")
    assert row["p99_ttft_ratio"] == {}  # no cost policy in this run
    assert report["targets"] == {"cost_p99_le_lru_per_rate": None, "cost_p99_le_half_none_at_highest_rate": None}
    assert report["daemon_exit"] == {"none": [0], "lru": [0]}
    for r in row["policies"].values():
        assert r["requests"] == r["completed"] == 14 and r["aborted"] == 0
        assert len(r["ttft_p99_ms_by_round"]) == 1 and r["ttft_p99_ms_by_round"][0] == r["ttft_ms"]["p99"]
        assert r["hits"] + r["misses"] == 14
        t = r["ttft_ms"]
        assert all(finite(t[k]) and t[k] > 0 for k in ("mean", "p50", "p90", "p99"))
        assert t["p50"] <= t["p90"] <= t["p99"]
    assert row["policies"]["lru"]["hit_rate"] > row["policies"]["none"]["hit_rate"]
