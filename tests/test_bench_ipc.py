"""The IPC round-trip benchmark runs tiny and reports one well-formed JSON object
(no timing assertions: benchmarks measure, tests check shape)."""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

from tests.shm_testing import SHM_DIR

ROOT = Path(__file__).resolve().parent.parent


def bench_segments() -> set[str]:
    return {p.name for p in SHM_DIR.glob("lpx-bench*")} if SHM_DIR.is_dir() else set()


def test_ipc_roundtrip_json() -> None:
    before = bench_segments()
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "ipc_roundtrip.py"), "--json", "--iters", "50", "--receivers", "1", "2"],
        capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["bench"] == "ipc_roundtrip" and report["iters"] == 50 and report["warmup"] >= 1
    assert report["host"]["cpu_count"] >= 1 and isinstance(report["host"]["has_futex"], bool)
    seen = {(r["variant"], r["receivers"]) for r in report["results"]}
    assert seen == {(v, n) for v in ("shm_futex", "zmq", "uds") for n in (1, 2)}
    for r in report["results"]:
        assert r["samples"] == 50
        values = [r[k] for k in ("min_us", "p50_us", "p90_us", "p99_us", "max_us")]
        assert all(math.isfinite(v) and v > 0 for v in values)
        assert values == sorted(values)
        assert r["min_us"] <= r["mean_us"] <= r["max_us"]
        assert len(r["receiver_cpus"]) == r["receivers"]
    assert report["target"]["max_us"] == 100.0 and isinstance(report["target"]["met"], bool)
    assert bench_segments() <= before, "the benchmark left its segment in /dev/shm"
