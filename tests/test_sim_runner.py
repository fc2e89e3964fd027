"""Simulator runs side by side in forked workers, their progress on stderr, and the --quick
presets: forked runs give the rows in-process runs give, a failing run names itself and
leaves no child behind, the progress line estimates the time left, and every scenario's
quick preset runs in seconds (`loraplex sim` once printed nothing for minutes)."""
from __future__ import annotations

import dataclasses
import io
import json
import os
import random
import resource
import subprocess
import sys

import pytest

from loraplex.cli import main as cli_main
from loraplex.daemon.sim import simulator
from loraplex.daemon.sim.profile import SimProfile
from loraplex.daemon.sim.progress import Progress, fmt_s
from loraplex.daemon.sim.runner import SimRun, run_all
from loraplex.daemon.sim.scenarios import SCENARIOS, run_variants, runs_per_rate
from loraplex.daemon.sim.simulator import SimConfig, simulate
from loraplex.daemon.sim.workload import WorkloadSpec, generate
from tests.test_sim import _NO_TRACE, _uses_trace


class FakeClock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _children() -> set[int]:
    """This process's children, zombies included (a forked worker not yet reaped stays one)."""
    found: set[int] = set()
    for task in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{task}/children") as fh:
            found.update(int(pid) for pid in fh.read().split())
    return found


@pytest.fixture(autouse=True)
def no_children_left():
    """Every worker a test forks is gone (reaped) when it ends; children that other tests of the
    suite left running (module-scoped daemons, say) are not this runner's to answer for."""
    before = _children()
    yield
    assert _children() <= before, f"workers left behind: {sorted(_children() - before)}"


def test_forked_workers_give_the_rows_of_in_process_runs() -> None:
    scenario = SCENARIOS["toppings-cluster"].quick_preset()  # a no-LoRA baseline first, then five routers
    small = dataclasses.replace(scenario.workload, max_requests=random.randint(120, 180), seed=random.randint(0, 999))
    alone, results = run_variants(scenario, small)  # in this process, results kept
    forked, none = run_variants(scenario, small, workers=3, keep_results=False)
    assert forked == alone and none == {} and len(results) == len(scenario.variants)


def test_a_failing_run_names_itself_and_leaves_no_child() -> None:
    events = generate(WorkloadSpec(seed=random.randint(0, 999), duration_s=5, rate_rps=4, num_adapters=3))
    ok = SimRun("fine", events, SimConfig(), SimProfile())
    bad = SimRun("stuck", events, SimConfig(max_steps=3), SimProfile())
    with pytest.raises(RuntimeError, match="simulation stuck failed: RuntimeError: simulation did not finish"):
        run_all([ok, bad, ok], workers=2)
    with pytest.raises(ValueError):
        run_all([ok], workers=0)


def test_the_simulator_reports_its_progress(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(simulator, "PROGRESS_EVERY", 16)
    events = generate(WorkloadSpec(seed=random.randint(0, 999), duration_s=60, rate_rps=5, num_adapters=20))
    shares: list[float] = []
    plain = simulate(events, SimConfig(), SimProfile())
    reported = simulate(events, SimConfig(), SimProfile(), progress=shares.append)
    assert reported.decisions == plain.decisions  # watching changes nothing
    assert shares and shares == sorted(shares) and 0 < shares[-1] <= 1


def test_the_progress_line_estimates_the_time_left() -> None:
    clock, out = FakeClock(), io.StringIO()
    progress = Progress("sim", 4, stream=out, clock=clock, every_s=5.0)
    progress.start(0, "random")
    progress.start(1, "first_fit")
    clock.t += 10.0
    progress.update(0, 0.5)  # 1 run of 4 worth of work in 10 s: 30 s left
    progress.update(1, 0.5)
    assert out.getvalue().splitlines() == [
        "sim: 0/4 runs done, running random 50%, first_fit 0%; 10 s so far, about 1 min 10 s left"]
    assert progress.line() == "sim: 0/4 runs done, running random 50%, first_fit 50%; 10 s so far, about 30 s left"
    clock.t += 1.0
    progress.done(0)  # under every_s since the last line: nothing written
    assert len(out.getvalue().splitlines()) == 1
    progress.finish()
    assert out.getvalue().splitlines()[-1] == "sim: 2 runs in 11 s"
    assert (fmt_s(59.4), fmt_s(125), fmt_s(3840)) == ("59 s", "2 min 05 s", "1 h 04 min")


def test_a_progress_of_unknown_length_estimates_the_runs_under_way() -> None:
    clock, out = FakeClock(), io.StringIO()
    progress = Progress("plan", None, stream=out, clock=clock, every_s=1.0)
    progress.start(0, "1 engine")
    clock.t += 4.0
    progress.done(0)
    progress.start(1, "2 engines")
    clock.t += 4.0
    progress.update(1, 0.6)  # 1.6 runs of work in 8 s: the 0.4 left take 2 s
    assert out.getvalue().splitlines()[-1] == "plan: 1 run done, running 2 engines 60%; 8 s so far, about 2 s left"


class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_on_a_terminal_the_line_is_rewritten_in_place() -> None:
    clock, out = FakeClock(), Tty()
    progress = Progress("sim", 2, stream=out, clock=clock)
    progress.start(0, "a-long-label")
    clock.t += 1.0
    progress.update(0, 0.5)
    clock.t += 1.0
    progress.done(0)
    progress.finish()
    text = out.getvalue()
    assert text.startswith("\rsim: 0/2 runs done") and text.count("\r") == 3
    assert text.endswith("\n") and text.rstrip().endswith("sim: 1 run in 2 s")
    first, second = text.split("\r")[1:3]
    assert len(second) >= len(first)  # a shorter line pads over the longer one it replaces


def _children_cpu_seconds() -> float:
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return children.ru_utime + children.ru_stime


@pytest.mark.parametrize("name", [pytest.param(n, marks=_NO_TRACE) if _uses_trace(n) else n
                                  for n in sorted(SCENARIOS)])
def test_every_scenario_has_a_quick_preset_of_seconds(name: str) -> None:
    scenario = SCENARIOS[name]
    quick = scenario.quick_preset()
    assert quick.workload != scenario.workload and quick.variants[0][0] == scenario.variants[0][0]
    # As a user runs it, in its own interpreter: workers forked from the suite's process would carry
    # its whole heap (every collection walks it) and cost twice the preset's CPU.
    cpu_before = _children_cpu_seconds()
    proc = subprocess.run([sys.executable, "-m", "loraplex.cli", "sim", "--scenario", name, "--quick", "--jobs", "2",
                           "--json"], capture_output=True, text=True, timeout=300)
    cpu = _children_cpu_seconds() - cpu_before
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads(proc.stdout)
    assert len(rows) == len(scenario.variants) * max(1, len(quick.rates))
    # CPU seconds (the run and its reaped workers), not wall time: another job on the host
    # stretches the wall clock, not the work. The largest preset takes about 10 s.
    assert cpu < 20.0, f"--quick took {cpu:.1f} CPU seconds"
    runs = runs_per_rate(scenario) * max(1, len(quick.rates))
    assert proc.stderr.splitlines()[-1].startswith(f"sim: {runs} runs in ")


def test_quick_wants_a_scenario(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["sim", "--quick"]) == 2
    assert "loraplex sim: error: --quick scales down a --scenario" in capsys.readouterr().err
    assert cli_main(["sim", "--scenario", "dlora", "--jobs", "0"]) == 2


def test_overlap_applies_to_every_variant_of_a_scenario(capsys: pytest.CaptureFixture[str]) -> None:
    """--no-overlap / --overlap set scheduler.overlap's twin in every variant; planning ahead shifts
    admissions by a step on this trace, so the two give other TTFTs (the default is --overlap)."""
    rows = {}
    for flag in ("--overlap", "--no-overlap", None):
        args = ["sim", "--scenario", "dlora", "--quick", "--jobs", "1", "--json"] + ([flag] if flag else [])
        assert cli_main(args) == 0
        rows[flag] = {r["label"]: r["mean_ttft_ms"] for r in json.loads(capsys.readouterr().out)}
    assert rows[None] == rows["--overlap"] != rows["--no-overlap"]
