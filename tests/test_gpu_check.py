"""The GPU validation harness runs its one-window plan dry on the CPU (so it cannot
rot between GPU windows), the plan for a 600 s window puts build and correctness
first, its reports have the promised shape, a failed or hung item fails its stage
without losing the report, and the RESULTS renderer replaces its own section only.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"
STAGES = ("build-test", "kernels", "e2e", "cpu-many-core")


@pytest.fixture(scope="module")
def harness():
    sys.path.insert(0, str(BENCH))
    try:
        import gpu_report
        from gpu_stages import harness, summary

        yield harness, summary, gpu_report
    finally:
        sys.path.remove(str(BENCH))


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess[str], Path]:
    out = tmp_path_factory.mktemp("gpu-check")
    env = {**os.environ, "LORAPLEX_CACHE_DIR": str(tmp_path_factory.mktemp("cache"))}
    proc = subprocess.run([sys.executable, str(BENCH / "gpu_check.py"), "--window", "600", "--dry-run", "--out",
                           str(out)], env=env, capture_output=True, text=True, timeout=600, check=False)
    return proc, out


def plan(*args: str) -> list[dict]:
    proc = subprocess.run([sys.executable, str(BENCH / "gpu_check.py"), "--plan", "--out", "unused", *args],
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout)["steps"]


def test_the_plan_of_one_600s_window_puts_build_and_correctness_first() -> None:
    steps = plan("--window", "600")
    tiers = [s["tier"] for s in steps]
    assert tiers == sorted(tiers), "most valuable first"
    essentials = [s for s in steps if s["tier"] <= 2]
    assert {"kernel_compile", "parity_kernels", "parity_attention", "parity_graphs", "parity_peft_offline",
            "parity_daemon", "parity_families"} <= {s["name"] for s in essentials}
    assert all(s["fits"] for s in essentials), essentials
    assert steps[:len(essentials)] == essentials
    headline = {s["name"] for s in steps if s["tier"] == 3}
    assert {"decode_7b_graphs_on", "ttft_7b", "adapter_load_7b", "kernels_bench"} <= headline


def test_the_whole_window_ran_dry_and_every_step_has_a_status(dry_run) -> None:
    proc, out = dry_run
    assert proc.returncode == 0, proc.stderr[-4000:]
    window = json.loads((out / "window.json").read_text())
    assert window["window_s"] == 600 and window["steps"]
    assert all(s["status"] in ("ok", "skipped") for s in window["steps"]), window["steps"]


def test_a_second_call_plans_only_what_the_first_did_not_reach(dry_run, tmp_path: Path) -> None:
    _, out = dry_run
    first = tmp_path / "first"
    first.mkdir()
    for stage in STAGES:
        if stage != "e2e":  # as if the first call was cut off before the e2e steps
            (first / f"{stage}.json").write_text((out / f"{stage}.json").read_text())
    steps = json.loads((out / "window.json").read_text())["steps"]
    skipped = {s["name"] for s in steps if s["status"] == "skipped"}
    rest = {s["name"] for s in plan("--window", "300", "--rest-of", str(first))}
    assert rest == {s["name"] for s in steps if s["stage"] == "e2e"} | skipped
    assert skipped and {s["name"] for s in plan("--window", "300", "--rest-of", str(out))} == skipped, \
        "only the steps that did not run are planned again"


def test_one_stage_still_runs_alone(tmp_path: Path) -> None:
    env = {**os.environ, "LORAPLEX_CACHE_DIR": str(tmp_path / "cache")}
    proc = subprocess.run([sys.executable, str(BENCH / "gpu_check.py"), "--stage", "cpu-many-core", "--dry-run",
                           "--out", str(tmp_path)], env=env, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads((tmp_path / "cpu-many-core.json").read_text())
    assert report["ok"] and {i["name"] for i in report["items"]} == {"workers_vs_threads", "round_trip"}


def test_all_four_stages_run_dry_and_report(dry_run) -> None:
    proc, out = dry_run
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = (out / "summary.md").read_text()
    for stage in STAGES:
        report = json.loads((out / f"{stage}.json").read_text())
        assert report["stage"] == stage and report["ok"] is True and report["dry_run"] is True
        assert report["device"].startswith("CPU") and report["seconds"] > 0
        statuses = {i["name"]: i["status"] for i in report["items"]}
        assert "failed" not in statuses.values(), statuses
        assert any(s == "ok" for s in statuses.values()), f"{stage}: nothing ran"
        for item in report["items"]:  # a skipped item always says why
            assert item["status"] != "skipped" or item["reason"], item
        assert all(t["met"] is None for t in report["targets"]), "a dry run cannot meet or miss a target"
        assert f"### Stage `{stage}`" in summary


def test_dry_run_exercises_the_real_paths(dry_run) -> None:
    _, out = dry_run
    build = {i["name"]: i for i in json.loads((out / "build-test.json").read_text())["items"]}
    assert build["parity_graphs"]["status"] == "skipped" and "CUDA" in build["parity_graphs"]["reason"]
    daemon = build["parity_daemon"]["figures"]
    assert daemon["cpu_assisted_rows"] > 0, "cpu_assist never assisted: the check compared on_demand with itself"
    assert daemon["on_demand_rows_equal_peft"] == daemon["rows"]
    kernels = json.loads((out / "kernels.json").read_text())
    assert {"gemv", "attention_decode", "attention_prefill", "perf_models"} <= set(kernels["figures"])
    assert (out / "router_profile.json").exists()
    e2e = json.loads((out / "e2e.json").read_text())
    modes = e2e["figures"]["ttft_tiny"]["modes"]
    assert set(modes) == {"cached", "on_demand", "cpu_assist"}
    assert all(m["completed"] == m["requests"] > 0 for m in modes.values())
    trip = json.loads((out / "cpu-many-core.json").read_text())["figures"]["round_trip_us"]["p50"]
    assert len(trip) == 2 and all(v > 0 for v in trip.values())


def test_renderer_writes_and_replaces_its_section(dry_run, harness, tmp_path: Path) -> None:
    _, _, gpu_report = harness
    _, out = dry_run
    results = tmp_path / "RESULTS.md"
    results.write_text("# Results\n\n## Other\n\nkept\n")
    assert gpu_report.main([str(out), "--results", str(results)]) == 0
    first = results.read_text()
    assert first.startswith("# Results\n\n## Other\n\nkept\n") and "**Dry run**" in first
    for stage in STAGES:
        assert f"### Stage `{stage}`" in first
    assert gpu_report.main([str(out), "--results", str(results)]) == 0
    assert results.read_text() == first, "a rerun must replace the section, not append another"
    assert gpu_report.main([str(tmp_path / "empty"), "--results", str(results)]) == 2


def test_failed_and_hung_items_fail_the_stage_but_keep_the_report(harness, tmp_path: Path) -> None:
    h, summary, _ = harness
    ctx = h.StageContext(stage="kernels", out=tmp_path, dry_run=True, device="cpu", budget_s=60.0)
    assert ctx.run("fails", [sys.executable, "-c", "import sys; sys.exit(3)"], est_s=1, parse_json=False) is None
    assert ctx.run("hangs", [sys.executable, "-c", "import time; time.sleep(30)"], est_s=1, cap_s=1.0) is None
    assert ctx.run("bad_json", [sys.executable, "-c", "print('not json')"], est_s=1) is None
    good = ctx.run("good", [sys.executable, "-c", "import json; print(json.dumps({'x': 1.5}))"], est_s=1)
    assert good == {"x": 1.5}
    ctx.budget_s = 0.0
    assert ctx.run("late", [sys.executable, "-c", "pass"], est_s=1) is None
    report = ctx.report({"name": "test host"})
    status = {i["name"]: (i["status"], i["reason"] or "") for i in report["items"]}
    assert status["fails"][0] == "failed" and "exit 3" in status["fails"][1]
    assert status["hangs"][0] == "failed" and "timed out" in status["hangs"][1]
    assert status["bad_json"][0] == "failed" and "not one JSON" in status["bad_json"][1]
    assert status["good"][0] == "ok" and status["late"] == ("skipped", status["late"][1])
    assert "budget" in status["late"][1]
    assert report["ok"] is False and report["failed"] == ["fails", "hangs", "bad_json"]
    text = summary.stage_markdown(report)
    assert "**failed**" in text and "| late | skipped |" in text


def test_targets_compare_in_their_direction(harness) -> None:
    h, _, _ = harness
    assert h.Target("t", 1.2, 1.4, ">=", "s").met is False
    assert h.Target("t", 1.6, 1.4, ">=", "s").met is True
    assert h.Target("t", 0.9, 1.0, "<=", "s").met is True
    assert h.Target("t", None, 1.0, "<=", "s").met is None


def test_without_cuda_a_real_run_refuses_instead_of_running_at_full_size(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    # No device visible, on a GPU host too.
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, str(BENCH / "gpu_check.py"), "--stage", "kernels", "--out",
                           str(tmp_path)], capture_output=True, text=True, timeout=120, check=False, env=env)
    assert proc.returncode == 2 and "--dry-run" in proc.stderr
    assert not (tmp_path / "kernels.json").exists()


def test_a_timed_out_item_takes_its_whole_process_group_with_it(harness, tmp_path: Path) -> None:
    """A bench script's daemons outlived its deadline (only the direct child was killed)."""
    harness = harness[0]
    pid_file = tmp_path / "grandchild.pid"
    script = ("import subprocess, sys, time; "
              "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
              f"open({str(pid_file)!r}, 'w').write(str(p.pid)); time.sleep(60)")
    with pytest.raises(subprocess.TimeoutExpired):
        harness.run_as_group([sys.executable, "-c", script], env=dict(os.environ), timeout_s=3)
    grandchild = int(pid_file.read_text())
    deadline = time.monotonic() + 5
    while Path(f"/proc/{grandchild}").exists() and time.monotonic() < deadline:
        time.sleep(0.05)  # killed; its parent is gone, so init reaps it
    assert not Path(f"/proc/{grandchild}").exists() or "Z" in Path(f"/proc/{grandchild}/stat").read_text().split()[2]
