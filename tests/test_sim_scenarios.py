"""Simulator pieces behind the paper scenarios: rank_aware routes on the simulated engines'
own PERF model and TPT SLO, the LCFS baseline serves the newest first, early abort beats
FCFS and LCFS under overload, and `loraplex sim` lets a scenario be shrunk or re-profiled."""
from __future__ import annotations

import dataclasses
import json

import pytest

from loraplex.cli import main as cli_main
from loraplex.daemon.sim.profile import SimProfile
from loraplex.daemon.sim.scenarios import SCENARIOS, run_variants
from loraplex.daemon.sim.simulator import SimConfig, Simulator, simulate
from loraplex.daemon.sim.workload import RequestEvent


def test_rank_aware_gets_the_simulated_profile_and_tpt_slo() -> None:
    profile = SimProfile(kernel="bgmv", alpha_ms=0.02, beta_ms=3.0)
    router = Simulator(SimConfig(router="rank_aware", num_engines=2, tpt_slo_ms=55.0), profile).router
    assert router.kernel == "bgmv" and router.slo_ms == 55.0  # type: ignore[attr-defined]
    assert router.profile.bgmv.alpha == 0.02 and router.profile.bgmv.beta == 3.0  # type: ignore[attr-defined]


@pytest.mark.parametrize(("kernel", "grouped"), [("bgmv", True), ("mbgmv", False)])
def test_rank_aware_groups_ranks_only_where_padding_costs(kernel: str, grouped: bool) -> None:
    # Alternating rank-8 and rank-128 requests on two engines: under padded BGMV a rank-8 row costs
    # as much as a rank-128 one beside rank 128, so each rank gets its own engine; under MBGMV
    # every engine pays the same increase and the lower resulting latency spreads them.
    events = [RequestEvent(f"r{i}", 0.0, "a" if i % 2 == 0 else "b", 8 if i % 2 == 0 else 128, 16, 4)
              for i in range(8)]
    result = simulate(events, SimConfig(router="rank_aware", num_engines=2, mode="cached", tpt_slo_ms=1e6),
                      SimProfile(kernel=kernel))
    ranks_by_engine = [{r.event.rank for r in result.records if r.engine == e} for e in (0, 1)]
    assert all(ranks_by_engine)
    assert all(len(ranks) == 1 for ranks in ranks_by_engine) == grouped


def test_lcfs_admits_the_newest_first() -> None:
    one_seat = SimProfile(max_num_seqs=1)
    events = [RequestEvent(f"r{i}", 0.001 * i, None, 0, 8, 4) for i in range(4)]
    order = {p: [rid for d in simulate(events, SimConfig(policy=p, mode="cached"), one_seat).decisions
                 for rid in d.admitted] for p in ("fcfs", "lcfs")}
    assert order["fcfs"] == ["r0", "r1", "r2", "r3"]
    assert order["lcfs"] == ["r0", "r3", "r2", "r1"]  # r0 ran alone before the others arrived


def test_early_abort_beats_fcfs_and_lcfs_under_overload() -> None:
    scenario = SCENARIOS["slora-abort"]
    workload = dataclasses.replace(scenario.workload, rate_rps=10.0, duration_s=30.0)
    rows = {r["label"]: r for r in run_variants(scenario, workload)[0]}
    assert rows["abort"]["aborted"] > 0 == rows["fcfs"]["aborted"]
    assert rows["abort"]["slo_attainment"] > rows["lcfs"]["slo_attainment"] > rows["fcfs"]["slo_attainment"]
    assert rows["abort"]["p99_ttft_ms"] <= scenario.variants[0][1].ttft_slo_ms  # what it serves, it serves in time


def test_unknown_policy_and_router_are_refused() -> None:
    with pytest.raises(ValueError, match="scheduling policy"):
        SimConfig(policy="edf")
    with pytest.raises(ValueError, match="router"):
        SimConfig(router="nearest")


def test_profile_overrides() -> None:
    profile = SimProfile().override(["kernel=bgmv", "beta_ms=12", "pool_pages=2000"])
    assert (profile.kernel, profile.beta_ms, profile.pool_pages) == ("bgmv", 12.0, 2000)
    for bad in ("colour=red", "beta_ms", "beta_ms=fast", "kernel=sgmv"):
        with pytest.raises(ValueError):
            SimProfile().override([bad])


def test_cli_shrinks_and_reprofiles_a_scenario(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["sim", "--scenario", "slora-abort", "--duration", "5", "--profile-set", "kernel=bgmv", "--json"]
    assert cli_main(argv) == 0
    rows = json.loads(capsys.readouterr().out)
    scenario = SCENARIOS["slora-abort"]
    assert len(rows) == len(scenario.rates) * len(scenario.variants)  # its own load sweep
    assert sorted({r["rate_rps"] for r in rows}) == list(scenario.rates)
    assert all(r["kernel"] == "bgmv" for r in rows)
    assert all(r["requests"] <= 12.0 * 5 * 2 for r in rows)  # 5 s of arrivals, not 60
    assert cli_main([*argv[:-1], "--rates", "8", "--json"]) == 0
    assert {r["rate_rps"] for r in json.loads(capsys.readouterr().out)} == {8.0}
    assert cli_main(["sim", "--scenario", "slora-abort", "--profile-set", "colour=red"]) == 2
