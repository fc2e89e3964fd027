"""bench/kernels.py runs end to end at tiny sizes under the interpreter and prints
well-formed JSON. Only shapes and sanity are checked: benchmarks are never timed
in tests, and interpreted timings say nothing about the kernels.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "kernels.py"


def positive(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


def test_kernels_bench_small_json() -> None:
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the flag must set it
    proc = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--interpret", "--small", "--json"],
                          env=env, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)  # the whole of stdout is one JSON object
    assert report["benchmark"] == "kernels"
    env_ = report["env"]
    assert env_["device"] == "cpu" and env_["interpret"] is True and env_["timings_meaningful"] is False
    assert positive(report["copy_gb_s"])
    cfg = report["config"]
    assert [(r["batch"], r["rank"]) for r in report["gemv"]] == [(b, k) for b in cfg["batch"] for k in cfg["ranks"]]
    for r in report["gemv"]:
        for kind in ("bgmv", "mbgmv", "torch"):
            assert positive(r[f"{kind}_s"]) and positive(r[f"{kind}_gb_s"]) and positive(r[f"{kind}_frac_of_copy"])
        assert r["bytes"] > 0 and r["ranks_sum"] >= r["batch"]
    mixed = [r for r in report["gemv"] if r["rank"] == "mixed" and r["batch"] > 1]
    assert mixed and all(r["ranks_sum"] not in (4 * r["batch"], 16 * r["batch"]) for r in mixed)
    assert report["sgmv"] and all(positive(r["sgmv_tflop_s"]) and positive(r["torch_tflop_s"])
                                  for r in report["sgmv"])
    assert report["attention_decode"] and all(positive(r["s"]) and positive(r["kv_gb_s"])
                                              for r in report["attention_decode"])


def test_kernels_bench_refuses_cpu_without_interpret() -> None:
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--small", "--json"], env=env,
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 2 and "--interpret" in proc.stderr and proc.stdout == ""
