"""The daemon overhead benchmark runs end to end and reports sane, finite figures."""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

from tests.bench_env import user_env

ROOT = Path(__file__).resolve().parent.parent


def test_daemon_overhead_json(demo):
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "daemon_overhead.py"), "--json", "--concurrency", "3",
         "--max-tokens", "4", "--ttft-samples", "2", "--stub-clients", "2", "--stub-requests", "40"],
        capture_output=True, text=True, timeout=300, env=user_env(),  # the script picks its demo itself
    )
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    real, stub = report["demo_model"], report["stub_engine"]
    assert real["steps"] > 0 and real["engine_ms_p50"] > 0
    assert real["step_ms_p50"] >= real["engine_ms_p50"] * 0.5
    assert math.isfinite(real["client_ttft_overhead_ms_median"])
    assert stub["requests"] == 40 and stub["requests_per_s"] > 0
