"""The bench/ scripts run end to end with small arguments and print well-formed JSON.

Each script runs as a subprocess, as a user would run it; the demo model goes to a
temporary LORAPLEX_CACHE_DIR. Only shapes and sanity of the numbers are checked here:
benchmarks are never timed in tests.
"""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.bench_env import user_env

BENCH = Path(__file__).resolve().parents[1] / "bench"


def run_script(name: str, args: list[str], cache: Path) -> subprocess.CompletedProcess[str]:
    env = user_env(LORAPLEX_CACHE_DIR=str(cache))
    return subprocess.run([sys.executable, str(BENCH / name), *args], env=env, capture_output=True,
                          text=True, timeout=120, check=False)


def run_json(name: str, args: list[str], cache: Path) -> dict[str, Any]:
    proc = run_script(name, [*args, "--json"], cache)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)  # the whole of stdout is one JSON object


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One demo install shared by the module's runs."""
    return tmp_path_factory.mktemp("loraplex-cache")


def positive(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


def is_waste(x: Any) -> bool:
    return isinstance(x, float) and 0.0 <= x < 1.0


def test_engine_threads_json(cache: Path) -> None:
    report = run_json("engine_threads.py", ["--shape", "tiny", "--threads", "1", "auto", "2", "--rounds", "1",
                                            "--max-tokens", "2", "--batch", "2"], cache)
    assert report["shape"] == "tiny" and positive(report["cores"]) and report["hogs"] == 1
    assert [r["threads"] for r in report["rows"]] == ["1", "auto", "2"]
    assert [r["count"] for r in report["rows"]][::2] == [1, 2]
    for row in report["rows"]:
        assert positive(row["quiet_tok_s"]) and positive(row["busy_tok_s"])
        assert len(row["quiet_runs"]) == len(row["busy_runs"]) == 1
        assert row["busy_over_quiet"] == pytest.approx(row["busy_tok_s"] / row["quiet_tok_s"], rel=0.01)
    assert max(r["quiet_over_best"] for r in report["rows"]) == 1.0


@pytest.mark.parametrize("mode", ["mixed", "none"])
def test_engine_throughput_json(cache: Path, mode: str) -> None:
    report = run_json("engine_throughput.py",
                      ["--batch", "1", "3", "--max-tokens", "4", "--prompt-len", "8", "--repeats", "1",
                       "--adapters", mode], cache)
    assert report["benchmark"] == "engine_throughput"
    env = report["env"]
    assert env["device"] == "cpu" and env["device_name"] and env["torch"]
    assert positive(env["threads"]) and len(env["loadavg_1m"]) == 2
    assert report["config"]["max_tokens"] == 4 and report["config"]["adapters"] == mode
    assert [r["batch"] for r in report["results"]] == [1, 3]
    for r in report["results"]:
        assert r["output_tokens"] == 4 * r["batch"]  # greedy with ignore_eos runs to max_tokens
        assert len(r["adapters"]) == r["batch"]
        if mode == "none":
            assert r["adapters"] == [None] * r["batch"]
        for key in ("e2e_s_median", "output_tok_s_median", "prefill_s_median", "prefill_tok_s"):
            assert positive(r[key]), key
        assert r["decode_tok_s"] is None or positive(r["decode_tok_s"])
    mixed = report["results"][1]["adapters"]
    if mode == "mixed":
        assert mixed[0] is None and all(isinstance(a, str) for a in mixed[1:])


def test_engine_throughput_table(cache: Path) -> None:
    proc = run_script("engine_throughput.py",
                      ["--batch", "2", "--max-tokens", "2", "--prompt-len", "4", "--repeats", "1",
                       "--adapters", "single"], cache)
    assert proc.returncode == 0, proc.stderr
    assert "out tok/s" in proc.stdout and "warm-up" in proc.stderr


def test_plan_codec_json(tmp_path: Path) -> None:
    report = run_json("plan_codec.py", ["--rows", "16", "--prefill-rows", "2", "--chunk", "8", "--context", "64",
                                        "--repeats", "2", "--batches", "2"], tmp_path)
    assert report["bench"] == "plan_codec" and report["plan"]["rows"] == 16 and report["plan"]["tokens"] == 14 + 16
    assert report["plan"]["page_ids"] >= 16 * (64 // 4) // 16
    for codec in (c for c in report["results"].values() if c is not None):
        assert codec["bytes"] > 0 and codec["total_us"] == codec["encode_us"] + codec["decode_us"] > 0
    if report["results"]["msgspec"] is not None:  # an optional package; same values, same msgpack bytes
        assert report["results"]["msgspec"]["bytes"] == report["results"]["msgpack"]["bytes"]
        assert report["speedup_total"] > 0


def test_page_waste_json(tmp_path: Path) -> None:
    traces = tmp_path / "traces"
    traces.mkdir()
    (traces / "AzureLLMInferenceTrace_conv.csv").write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,10,6\n2023-11-16 18:15:50.99,16,1\n"
    )
    report = run_json("page_waste.py", ["--page-tokens", "32", "1", "--traces-dir", str(traces)], tmp_path)
    assert report["benchmark"] == "page_waste"
    assert report["ranks"] == [8, 16, 32, 64, 128]
    # The code trace is absent from this directory and is skipped; the conv one has lengths 16 and 17.
    assert set(report["kv_distributions"]) == {"uniform_1_4096", "azure_conv_2023"}
    assert report["kv_distributions"]["azure_conv_2023"]["sequences"] == 2
    models = {m["name"]: m for m in report["models"]}
    assert set(models) == {"demo", "llama-2-7b", "llama-3-8b"}
    assert models["llama-3-8b"]["dims"]["kv_dim"] == 1024
    for m in models.values():
        default, extra, too_small = m["geometries"]
        assert default["default"] and default["page_tokens"] == 16 and extra["page_tokens"] == 32
        assert "error" in too_small  # one token's K and V cannot hold the widest adapter row
        for g in (default, extra):
            assert positive(g["page_elems"]) and positive(g["page_bytes_per_layer"])
            assert g["page_bytes_all_layers"] == g["page_bytes_per_layer"] * m["dims"]["layers"]
            for by_rank in g["adapter"].values():
                assert set(by_rank) == {"8", "16", "32", "64", "128"}
                for cell in by_rank.values():
                    assert positive(cell["pages_per_layer"]) and is_waste(cell["waste"])
            for kv in g["kv"].values():
                assert is_waste(kv["mean"]) and is_waste(kv["aggregate"])
        conv = default["kv"]["azure_conv_2023"]
        assert conv["mean"] == pytest.approx((0.0 + (1 - 17 / 32)) / 2)
        assert conv["aggregate"] == pytest.approx(1 - 33 / 48)
        for rp in m["row_pages"]:
            assert is_waste(rp["kv_waste_per_token"])
            assert all(is_waste(a["waste"]) for a in rp["adapter"].values())
    # Llama-2-7B: q/v rows are 4096 wide and a 16-token page holds 32 of them exactly.
    assert models["llama-2-7b"]["geometries"][0]["adapter"]["qv"]["8"]["waste"] == 0.0


def test_decode_profile_fits_and_writes_a_profile_the_router_reads(cache: Path, tmp_path: Path) -> None:
    from loraplex.daemon.router import PerfProfile

    out = tmp_path / "perf.json"
    report = run_json("decode_profile.py", ["--shape", "tiny", "--batches", "1", "3", "--ranks", "4", "8",
                                            "--distinct", "3", "--fit-distinct", "2", "--steps", "2",
                                            "--context", "8", "--profile-out", str(out)], cache)
    assert report["overhead"]["distinct_adapters"] == 3 and positive(report["overhead"]["base_step_ms"])
    assert len(report["samples"]["bgmv"]) == 2 * 3  # batches x (each rank + the mixed batch)
    profile = PerfProfile.load(out)
    for kernel in ("bgmv", "mbgmv"):
        fit = report["fits"][kernel]
        assert getattr(profile, kernel).r2 == fit["r2"] and fit["r2"] <= 1.0
        assert getattr(profile, kernel).alpha == max(fit["alpha"], 0.0)


def test_least_squares_fit_recovers_a_known_line_and_refuses_one_point() -> None:
    sys.path.insert(0, str(BENCH))
    try:
        from decode_profile import fit_line
    finally:
        sys.path.pop(0)
    xs = [8.0, 64.0, 256.0, 1024.0, 4096.0]
    fit = fit_line(xs, [0.0125 * x + 7.5 for x in xs])
    assert math.isclose(fit["alpha"], 0.0125) and math.isclose(fit["beta"], 7.5) and math.isclose(fit["r2"], 1.0)
    noisy = fit_line(xs, [0.0125 * x + 7.5 + (3.0 if i % 2 else -3.0) for i, x in enumerate(xs)])
    assert 0.0 < noisy["r2"] < 1.0
    with pytest.raises(ValueError):
        fit_line([4.0, 4.0], [1.0, 2.0])


def test_flood_gap_json(cache: Path) -> None:
    report = run_json("flood_gap.py", ["--requests", "2", "--clients", "2", "--prompt-bytes", "200000",
                                       "--stream-s", "0.5"], cache)
    assert report["benchmark"] == "flood_gap" and report["config"]["requests_per_client"] == 2
    for phase in ("alone", "flooded"):
        assert report[phase]["stream_error"] is None and report[phase]["tokens"] >= 1
        assert positive(report[phase]["max_gap_ms"]) and report[phase]["p99_gap_ms"] <= report[phase]["max_gap_ms"]
    assert report["flooded"]["flood"]["codes"] == {"prompt_too_long": 4}
    assert report["daemon"]["healthy_after"] and report["daemon"]["exit_status"] == 0
    assert report["env"]["cpu_count"] >= 1 and positive(report["daemon"]["rss_mib_after_flood"])

@pytest.mark.slow  # four daemon start-ups: ~30 s on a busy 2-core host
def test_many_adapters_small_json(cache: Path) -> None:
    report = run_json("many_adapters.py", ["--small"], cache)
    assert [r["n"] for r in report["results"]] == report["config"]["counts"]
    for r in report["results"]:
        assert r["adds_timed"] >= 1 and positive(r["add_ms"]["p50"]) and r["add_ms"]["p99"] >= r["add_ms"]["p50"]
        assert positive(r["list_ms"]["median"]) and positive(r["ready_s"]["median"])
        assert all(positive(v) for v in r["rss_mib"]["at_ready"].values())
        assert positive(r["ttft_ms"]["cold_median"]) and positive(r["ttft_ms"]["warm_median"])
        assert set(r["ttft_ms"]["cold_tiers"]) <= {"gpu", "host", "disk"}
        counts = r["adapter_counts"]
        assert counts["total"] == r["n"] and sum(counts["tiers"].values()) == r["n"] and counts["error"] == 0


def test_grammar_mask_reports_both_libraries(tmp_path):
    pytest.importorskip("xgrammar")
    pytest.importorskip("llguidance")
    report = run_json("grammar_mask.py", ["--steps", "3", "--repeats", "1", "--batch", "4", "--big-vocab", "700",
                                          "--corpus-mb", "0.05"], tmp_path)
    assert set(report["libraries"]) == {"xgrammar", "llguidance"} and report["batch"] == 4
    for by_vocab in report["libraries"].values():
        assert len(by_vocab) == 2
        for modes in by_vocab.values():
            assert set(modes) == {"per_row", "batch_call"}
            assert all(positive(r["step_ms_p50"]) and positive(r["per_row_us"]) for r in modes.values())
