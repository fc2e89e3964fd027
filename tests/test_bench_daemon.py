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
    stub = report["stub_engine"]
    assert (report["demo_model"]["loop"], report["demo_model_overlap"]["loop"]) == ("sync", "overlap")
    for real in (report["demo_model"], report["demo_model_overlap"]):
        assert real["steps"] > 0 and real["engine_ms_p50"] > 0 and real["tokens_per_s"] > 0
        assert real["step_ms_p50"] >= real["engine_ms_p50"] * 0.5
        assert math.isfinite(real["client_ttft_overhead_ms_median"])
    assert stub["requests"] == 40 and stub["requests_per_s"] > 0


def test_stub_step_configurations_report_the_exposed_overhead():
    """--stub-step-ms: a stub engine process sleeping per step serves B requests of C-token
    prompts; each configuration reports its decode steps' interval and plan size."""
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "daemon_overhead.py"), "--json", "--stub-only", "--stub-step-ms", "3",
         "--batch", "1", "5", "--context", "40", "--stub-decode-steps", "6"],
        capture_output=True, text=True, timeout=300, env=user_env(),
    )
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    configs = [(c["batch"], c["context"], c["loop"]) for c in report["stub"]]
    assert "demo_model" not in report  # --stub-only; both loops side by side, by default
    assert configs == [(1, 40, "sync"), (1, 40, "overlap"), (5, 40, "sync"), (5, 40, "overlap")]
    for config in report["stub"]:
        assert config["step_ms"] == 3.0 and config["decode_steps"] >= 5
        # The engine slept 3 ms a step, so two step starts are at least that far apart.
        assert config["step_interval_ms_p50"] >= 3.0 and math.isfinite(config["exposed_overhead_frac"])
        assert config["exposed_overhead_ms_p50"] == config["step_interval_ms_p50"] - 3.0
        assert config["plan_bytes_p50"] > 0
    one, five = report["stub"][1], report["stub"][3]
    assert five["plan_bytes_p50"] > one["plan_bytes_p50"]  # five rows in each decode plan, not one
