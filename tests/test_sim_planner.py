"""`loraplex plan`: the capacity planner finds the fewest engines meeting the SLO attainment
target (checked by hand on a tiny trace), never asks for fewer engines for more load,
reports every N it tried, and fails cleanly on bad input or an unreachable target."""
from __future__ import annotations

import dataclasses
import json

import pytest

from loraplex.cli import main as cli_main
from loraplex.daemon.sim.planner import TABLE_KEYS, PlanSpec, plan
from loraplex.daemon.sim.profile import SimProfile
from loraplex.daemon.sim.simulator import SimConfig
from loraplex.daemon.sim.workload import RequestEvent, WorkloadSpec, generate, trace_path

# One request per engine at a time, every step 10 ms: a 4-token prompt and 3 output tokens take
# three steps (first token at 10 ms, done at 30 ms, TPT 10 ms). With N engines and 4 requests
# arriving together, the first N get TTFT 10 ms and the rest wait >= 30 ms: attainment min(N, 4)/4.
UNIT = SimProfile(max_num_seqs=1, alpha_ms=0.0, beta_ms=10.0, prefill_ms_per_token=0.0, decode_ms_per_row=0.0)
FOUR = [RequestEvent(f"r{i}", 0.0, None, 0, 4, 3) for i in range(4)]
TIGHT = SimConfig(mode="cached", router="most_idle", ttft_slo_ms=20.0, tpt_slo_ms=15.0)


@pytest.mark.parametrize(("target", "engines", "tried"), [
    (0.99, 4, [1, 2, 3, 4]),  # 1, 2, 4 (met), then 3 between the last miss and the first hit
    (0.75, 3, [1, 2, 3, 4]),
    (0.5, 2, [1, 2]),
    (0.25, 1, [1]),
])
def test_tiny_case_by_hand(target: float, engines: int, tried: list[int]) -> None:
    result = plan(FOUR, PlanSpec(TIGHT, target_attainment=target, max_engines=8), UNIT)
    assert result.engines == engines
    assert [r["engines"] for r in result.table] == tried
    for row in result.table:
        assert row["slo_attainment"] == min(int(row["engines"]), 4) / 4  # type: ignore[arg-type]
        assert row["meets"] == (row["slo_attainment"] >= target)


def test_max_engines_caps_the_search() -> None:
    result = plan(FOUR, PlanSpec(TIGHT, target_attainment=0.99, max_engines=3), UNIT)
    assert result.engines is None
    assert [r["engines"] for r in result.table] == [1, 2, 3]
    assert not any(r["meets"] for r in result.table)


@pytest.mark.parametrize("seed", [0, 1])
def test_more_load_never_needs_fewer_engines(seed: int) -> None:
    # The same 160 requests replayed faster: only the load changes.
    base = WorkloadSpec(seed=seed, duration_s=1e6, max_requests=160, num_adapters=40, prompt_mean=128,
                        output_mean=48)
    spec = PlanSpec(SimConfig(mode="cached", ttft_slo_ms=1000.0, tpt_slo_ms=40.0), max_engines=32)
    needed = [plan(generate(dataclasses.replace(base, rate_rps=rate)), spec).engines for rate in (2.0, 8.0, 24.0)]
    assert None not in needed
    assert needed == sorted(needed)  # type: ignore[type-var]
    assert needed[0] < needed[-1]


def test_empty_workload_is_an_error() -> None:
    with pytest.raises(ValueError, match="no requests"):
        plan([], PlanSpec(TIGHT))
    with pytest.raises(ValueError, match="target attainment"):
        PlanSpec(TIGHT, target_attainment=0.0)
    with pytest.raises(ValueError, match="max engines"):
        PlanSpec(TIGHT, max_engines=0)


SMALL = ["plan", "--duration", "20", "--rate", "6", "--adapters", "20", "--prompt-mean", "128",
         "--output-mean", "32", "--mode", "cached", "--max-engines", "8"]


def test_cli_json_schema(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main([*SMALL, "--slo-tpt-ms", "40", "--slo-ttft-ms", "1000", "--json"]) == 0
    captured = capsys.readouterr()
    out = json.loads(captured.out)
    assert {"engines", "met", "target_attainment", "max_engines", "slo_ttft_ms", "slo_tpt_ms", "scheduler", "router",
            "cache_policy", "mode", "requests", "workload", "profile", "table"} <= set(out)
    assert out["met"] is True and out["target_attainment"] == 0.99 and out["slo_tpt_ms"] == 40.0
    assert out["workload"]["rate_rps"] == 6.0 and out["requests"] > 0
    table = out["table"]
    assert [r["engines"] for r in table] == sorted(r["engines"] for r in table)
    for row in table:
        assert set(row) == {*TABLE_KEYS, "meets"}
        assert row["meets"] == (row["slo_attainment"] >= 0.99)
    assert out["engines"] == min(r["engines"] for r in table if r["meets"])
    below = [r for r in table if r["engines"] == out["engines"] - 1]
    assert out["engines"] == 1 or (below and not below[0]["meets"])  # the answer is the smallest N
    assert f"plan: {out['engines']} engine(s): attainment" in captured.err  # progress on stderr


def test_cli_writes_a_serve_config_for_the_engines_found(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "serve.yaml"
    assert cli_main([*SMALL, "--slo-tpt-ms", "40", "--slo-ttft-ms", "1000", "--json", "--serve-config", str(path)]) == 0
    engines = json.loads(capsys.readouterr().out)["engines"]
    config = json.loads(path.read_text())  # JSON is YAML: `serve deploy` reads it
    (app,) = config["applications"]
    assert app["import_path"] == "loraplex.cluster.app:build_app" and app["args"]["replicas"] == engines
    from loraplex.cluster.config import ClusterConfig

    assert ClusterConfig.from_dict(app["args"]).replicas == engines  # what build_app will parse


def test_cli_table_and_answer(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main([*SMALL, "--slo-tpt-ms", "40", "--slo-ttft-ms", "1000"]) == 0
    out = capsys.readouterr().out
    assert "slo_attainment" in out and "engine(s) meet 99.00% attainment" in out


def test_cli_unreachable_target_fails_clearly(capsys: pytest.CaptureFixture[str]) -> None:
    # No batch of requests decodes a token in under 1 ms with an 8 ms step: no N can do it.
    assert cli_main([*SMALL, "--slo-tpt-ms", "1", "--max-engines", "4", "--json"]) == 1
    captured = capsys.readouterr()
    assert json.loads(captured.out)["engines"] is None
    assert "no engine count up to 4 reaches 99.00% SLO attainment" in captured.err


@pytest.mark.parametrize(("extra", "message"), [
    (["--slo-tpt-ms", "40", "--target-attainment", "1.5"], "target attainment must be in (0, 1]"),
    (["--slo-tpt-ms", "0"], "SLOs"),
    (["--slo-tpt-ms", "40", "--router", "nearest"], "unknown router"),
    (["--slo-tpt-ms", "40", "--scheduler", "edf"], "unknown scheduling policy"),
    (["--slo-tpt-ms", "40", "--trace", "/nonexistent/trace.csv"], "No such file"),
])
def test_cli_bad_input(extra: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main([*SMALL, *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith("loraplex plan: error:") and message in err


def test_slo_tpt_is_required(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli_main(["plan"])
    assert exc.value.code == 2
    assert "--slo-tpt-ms" in capsys.readouterr().err


@pytest.mark.skipif(not trace_path("conv").is_file(), reason="shared/traces not present")
def test_trace_alone_replays_its_arrivals_and_lengths(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", "--trace", "conv", "--duration", "30", "--time-scale", "2", "--slo-tpt-ms", "80",
            "--mode", "cached", "--max-engines", "4", "--json"]
    assert cli_main(argv) in (0, 1)
    out = json.loads(capsys.readouterr().out)
    assert out["workload"]["arrival"] == "trace" and out["workload"]["lengths"] == "trace"
    assert out["requests"] > 0
