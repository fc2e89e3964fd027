"""`loraplex bench serve` drives a live daemon with the simulator's workload spec."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.daemon_process import DaemonProcess


def test_bench_serve_reports_live_figures(demo, tmp_path):
    proc = DaemonProcess(tmp_path).start()
    try:
        out = subprocess.run(
            [sys.executable, "-m", "loraplex.cli", "bench", "serve", "--json", "--runtime-dir", str(proc.runtime_dir),
             "--rate", "20", "--max-requests", "8", "--duration", "5", "--prompt-mean", "24", "--output-mean", "6",
             "--adapters", "4"],
            env={**os.environ}, capture_output=True, text=True, timeout=180)
    finally:
        assert proc.stop() == 0, proc.log()
    assert out.returncode == 0, out.stderr
    row = json.loads(out.stdout)
    assert row["requests"] == 8 and row["completed"] == 8 and row["aborted"] == 0
    for key in ("mean_ttft_ms", "p99_ttft_ms", "mean_tpt_ms", "throughput_rps", "slo_attainment", "cache_hit_rate"):
        assert key in row
    assert row["mean_ttft_ms"] > 0 and row["throughput_rps"] > 0 and 0 <= row["cache_hit_rate"] <= 1
