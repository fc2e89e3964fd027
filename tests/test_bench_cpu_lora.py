"""bench/cpu_lora_compute.py runs end to end at tiny sizes and prints well-formed JSON.

Runs as a subprocess, as a user would. Only shapes and sanity are checked;
benchmarks are never timed in tests."""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

from loraplex.ipc.shm import list_segments
from tests.bench_env import user_env

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "cpu_lora_compute.py"


def positive(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


def test_small_run_json(tmp_path: Path) -> None:
    before = set(list_segments("/lpx-cpubench"))
    env = user_env(LORAPLEX_CACHE_DIR=str(tmp_path))
    args = ["--small", "--json", "--ranks", "8", "--prompt-lens", "8", "24", "--parallel-ranks", "4", "8",
            "--parallel-lens", "10", "--repeats", "1", "--workers", "2"]
    proc = subprocess.run([sys.executable, str(SCRIPT), *args], env=env, capture_output=True, text=True,
                          timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)  # the whole of stdout is one JSON object
    assert set(list_segments("/lpx-cpubench")) == before, "the benchmark left shared-memory segments behind"

    assert report["benchmark"] == "cpu_lora_compute"
    env_info, cfg = report["env"], report["config"]
    assert env_info["device"] == "cpu" and env_info["device_name"] and env_info["torch"]
    assert len(env_info["loadavg_1m"]) == 2
    assert cfg["hidden"] == 256 and cfg["workers"] == 2 and len(cfg["cores"]) == 2 and cfg["small"]

    assert [(r["rank"], r["prompt_len"]) for r in report["per_core"]] == [(8, 8), (8, 24)]
    for row in report["per_core"]:
        assert positive(row["tokens_per_s"]) and positive(row["ms_median"])

    assert [(r["rank"], r["prompt_len"]) for r in report["parallel"]] == [(4, 10), (8, 10)]
    for row in report["parallel"]:
        assert row["workers"] == 2 and row["layers"] == 2
        for key in ("multiproc_ms", "threads_ms", "ratio", "ratio_best", "multiproc_tokens_per_s",
                    "threads_tokens_per_s", "multiproc_worker_busy_ms"):
            assert positive(row[key]), key
        assert len(row["multiproc_runs_ms"]) == len(row["threads_runs_ms"]) == 1
        assert row["max_rel_err"] < 1e-4  # both arms computed the right deltas

    summary = report["summary"]
    assert summary["target_ratio"] == 1.4
    assert summary["ratio_min"] <= summary["ratio_geomean"] <= summary["ratio_max"]
