"""The simulator: the daemon's own policies on a virtual clock give sane latencies (more load,
more waiting; cached <= cpu_assist <= on_demand when loads stall the step), record their decisions, and the named
scenarios, --compare, plots and the `loraplex sim` command all work."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from loraplex.cli import main as cli_main
from loraplex.daemon.sim.metrics import summarize
from loraplex.daemon.sim.profile import SimProfile
from loraplex.daemon.sim.scenarios import SCENARIOS, run_variants
from loraplex.daemon.sim.simulator import SimConfig, simulate
from loraplex.daemon.sim.workload import WorkloadSpec, generate, trace_path

REQUIRED = {"policy", "slo_attainment", "mean_tpt_ms", "mean_ttft_ms", "p99_ttft_ms", "throughput_rps"}
SMALL = WorkloadSpec(seed=1, duration_s=30, rate_rps=2.0, num_adapters=100, zipf_exponent=0.8,
                     prompt_mean=256, output_mean=32)
TIGHT = SimProfile(pool_pages=800, pcie_bytes_per_s=2e9)


def test_more_load_means_longer_ttft() -> None:
    same = dataclasses.replace(SMALL, max_requests=80, duration_s=1e6)  # the same requests, time-scaled
    rows = [summarize(simulate(generate(dataclasses.replace(same, rate_rps=rate)), SimConfig(), TIGHT))
            for rate in (0.5, 4.0, 12.0)]
    ttft = [r["mean_ttft_ms"] for r in rows]
    assert ttft == sorted(ttft) and ttft[0] < ttft[-1]
    assert all(r["completed"] == r["requests"] for r in rows)


def test_loading_modes_order_ttft_and_count_pcie_bytes() -> None:
    events = generate(SMALL)
    row = {m: summarize(simulate(events, SimConfig(mode=m), TIGHT)) for m in ("cached", "on_demand", "cpu_assist")}
    assert row["cached"]["mean_ttft_ms"] <= row["cpu_assist"]["mean_ttft_ms"] <= row["on_demand"]["mean_ttft_ms"]
    assert row["cached"]["mean_ttft_ms"] < row["on_demand"]["mean_ttft_ms"]
    assert row["cached"]["pcie_bytes"] == 0 < row["on_demand"]["pcie_bytes"]
    assert row["cpu_assist"]["pcie_bytes"] > 0


def test_cpu_assist_lies_between_when_the_cpu_is_slow() -> None:
    """Against on_demand loads that stall the step (admit_when_loaded off): a slow CPU still
    beats waiting for the copy, but no longer matches cached."""
    events = generate(SMALL)
    slow = dataclasses.replace(TIGHT, cpu_lora_rank_tokens_per_s=2e5)
    ttft = {m: summarize(simulate(events, SimConfig(mode=m, admit_when_loaded=False), slow))["mean_ttft_ms"]
            for m in ("cached", "on_demand", "cpu_assist")}
    assert ttft["cached"] < ttft["cpu_assist"] <= ttft["on_demand"]


def test_admitting_when_loaded_spares_the_batch_the_copy() -> None:
    """on_demand: a request whose adapter is still loading waits in the queue instead of
    stalling the step; the others run on, so TTFT falls, and every request still completes."""
    events = generate(SMALL)
    slow_link = dataclasses.replace(TIGHT, pcie_bytes_per_s=2e8)
    rows = {flag: summarize(simulate(events, SimConfig(mode="on_demand", admit_when_loaded=flag), slow_link))
            for flag in (False, True)}
    assert rows[True]["completed"] == rows[False]["completed"] == len(events)
    assert rows[True]["mean_ttft_ms"] < 0.9 * rows[False]["mean_ttft_ms"]
    assert rows[True]["pcie_bytes"] > 0


def test_decisions_are_recorded_and_reproducible() -> None:
    events = generate(dataclasses.replace(SMALL, max_requests=60))
    a, b = simulate(events, SimConfig(), TIGHT), simulate(events, SimConfig(), TIGHT)
    assert a.decisions == b.decisions and a.decisions
    admitted = [rid for d in a.decisions for rid in d.admitted]
    assert sorted(admitted) == sorted(e.request_id for e in events)  # no preemption here: admitted once each
    assert [d.time_s for d in a.decisions] == sorted(d.time_s for d in a.decisions)
    for d in a.decisions:
        assert set(d.admitted) <= set(d.rows)
    for rec in a.records:
        assert rec.finish_s is not None and rec.output_tokens == rec.event.output_len
        assert rec.event.arrival_s <= rec.first_token_s <= rec.finish_s


@pytest.mark.parametrize("router", ["most_idle", "rank_aware", "dlora", "random"])
def test_several_engines_share_the_load(router: str) -> None:
    events = generate(dataclasses.replace(SMALL, rate_rps=6.0, duration_s=15))
    one = summarize(simulate(events, SimConfig(), TIGHT))
    result = simulate(events, SimConfig(num_engines=3, router=router), TIGHT)
    three = summarize(result)
    assert three["completed"] == len(events)
    assert len({d.engine for d in result.decisions}) > 1
    assert three["mean_ttft_ms"] < one["mean_ttft_ms"]


def test_early_abort_counts_as_missing_the_slo() -> None:
    events = generate(dataclasses.replace(SMALL, rate_rps=12.0, duration_s=10))
    row = summarize(simulate(events, SimConfig(early_abort=True, ttft_slo_ms=200.0), TIGHT))
    assert row["aborted"] > 0
    assert row["slo_attainment"] <= 1 - row["aborted"] / row["requests"]


def test_profile_json_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"alpha_ms": 0.02, "pcie_bytes_per_s": 1e10}))
    assert SimProfile.load(path) == SimProfile(alpha_ms=0.02, pcie_bytes_per_s=1e10)
    path.write_text(json.dumps({"bogus": 1}))
    with pytest.raises(ValueError, match="bogus"):
        SimProfile.load(path)
    with pytest.raises(ValueError):
        SimProfile(pcie_bytes_per_s=0)


def _uses_trace(name: str) -> bool:
    w = SCENARIOS[name].workload
    return w.arrival == "trace" or w.lengths == "trace"


# The Azure traces live beside the checkout (../shared/traces), not in it: a clean clone may lack them.
_NO_TRACE = pytest.mark.skipif(not trace_path("conv").is_file(), reason="shared/traces not present")


@pytest.mark.parametrize("name", [pytest.param(n, marks=_NO_TRACE) if _uses_trace(n) else n
                                  for n in sorted(SCENARIOS)])
def test_every_scenario_runs(name: str) -> None:
    scenario = SCENARIOS[name]
    small = dataclasses.replace(scenario.workload, max_requests=150)  # seconds, not minutes
    rows, results = run_variants(scenario, small)
    assert len(rows) == len(SCENARIOS[name].variants) >= 2
    for row in rows:
        assert REQUIRED <= set(row)
        assert 0 <= row["slo_attainment"] <= 1 and row["throughput_rps"] > 0
        if scenario.tpt_slo_x is not None:  # the TPT SLO is set from the same trace served without LoRA
            assert row["tpt_slo_ms"] == pytest.approx(scenario.tpt_slo_x * row["no_lora_tpt_ms"])
    assert [r["policy"] for r in rows] == [label for label, _ in SCENARIOS[name].variants]


def test_cli_scenario_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["sim", "--scenario", "toppings-modes", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["policy"] for r in rows] == ["cached", "on_demand", "cpu_assist"]
    assert all(REQUIRED <= set(r) for r in rows)


def test_cli_compare_prints_ratios(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["sim", "--compare", "cache_policy=none,lru,cost", "--duration", "20", "--adapters", "100", "--json"]
    assert cli_main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert [r["label"] for r in out["ratios"]] == ["none", "lru", "cost"]
    assert out["ratios"][0]["mean_ttft_ms"] == 1.0
    assert out["rows"][1]["cache_hit_rate"] >= out["rows"][0]["cache_hit_rate"]
    assert cli_main(argv[:-1]) == 0
    text = capsys.readouterr().out
    assert "ratios to none" in text and "lru" in text
    assert cli_main(["sim", "--compare", "colour=red"]) == 2


def test_cli_decision_log_has_a_line_per_step(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from loraplex.daemon.decision_log import read_decisions

    log = tmp_path / "decisions.jsonl"
    argv = ["sim", "--duration", "5", "--rate", "3", "--adapters", "4", "--prompt-mean", "64", "--output-mean", "8",
            "--decision-log", str(log), "--json"]
    assert cli_main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    decisions = read_decisions(log)
    assert len(decisions) == out["steps"] > 0
    admitted = [rid for d in decisions for rid in d.admitted]
    assert sorted(admitted) == sorted(set(admitted)) and len(admitted) == out["requests"]
    assert all(set(d.admitted) <= set(d.rows) for d in decisions)
    assert cli_main(["sim", "--compare", "policy=fcfs,mlq", "--decision-log", str(log)]) == 2


def test_cli_writes_pngs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["sim", "--compare", "mode=cached,on_demand", "--duration", "10", "--rates", "1", "3",
            "--plot-dir", str(tmp_path), "--json"]
    assert cli_main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["rows"]) == 4 and len(out["plots"]) == 3
    for path in out["plots"]:
        assert Path(path).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_simulator_is_torch_free() -> None:
    import subprocess
    import sys

    code = ("import sys, loraplex.daemon.sim.cli, loraplex.daemon.sim.simulator, loraplex.daemon.sim.scenarios, "
            "loraplex.daemon.sim.planner; "
            "print('torch' in sys.modules, 'matplotlib' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]
