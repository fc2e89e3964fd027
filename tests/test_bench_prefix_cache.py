"""bench/prefix_cache.py runs as bench/README.md shows it (--quick) and prints one JSON object:
the three modes on the same multi-turn chat workload. Shapes and sanity only: benchmarks are
never timed in tests, but what the cache saves is counted, not timed."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "prefix_cache.py"


def test_prefix_cache_bench_compares_the_three_modes_on_one_workload() -> None:
    proc = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--json"], capture_output=True, text=True,
                          timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    rows = {r["mode"]: r for r in out["results"]}
    assert list(rows) == ["off", "separate", "unified"]
    assert len({(r["requests"], r["prompt_tokens"]) for r in rows.values()}) == 1  # the same workload
    off = rows["off"]
    assert off["cached_prompt_tokens"] == 0 and off["prefill_tokens"] == off["prompt_tokens"]
    for mode in ("separate", "unified"):
        row = rows[mode]
        assert row["finished"] == row["requests"] > 100
        # Later turns extend earlier ones: the cache must hold some of their history.
        assert 0 < row["cached_prompt_tokens"] < row["prompt_tokens"]
        assert row["prefill_tokens"] == row["prompt_tokens"] - row["cached_prompt_tokens"]
        assert row["p50_ttft_ms"] <= row["p99_ttft_ms"]
