"""`loraplex sim`: arguments and output of the simulator command (torch-free).

A named scenario (--scenario), or one run / a comparison (--compare KEY=a,b,c) on a
workload built from the flags; --rates sweeps load (a scenario sweeps its own rates unless
given); workload flags given with --scenario override that scenario's workload (to shrink
it); --json prints one JSON value on stdout (an object for a single run or comparison, a
list of rows for a scenario); --plot-dir writes PNGs (TTFT CDFs, and latency vs load when
rates are swept). The workload flags are shared with `loraplex plan`.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from loraplex.daemon.decision_log import StepDecision, write_decisions
from loraplex.daemon.sim.metrics import format_table, ratios
from loraplex.daemon.sim.profile import SimProfile
from loraplex.daemon.sim.progress import Progress
from loraplex.daemon.sim.runner import default_workers
from loraplex.daemon.sim.scenarios import SCENARIOS, Scenario, get, run_variants, runs_per_rate, sweep
from loraplex.daemon.sim.simulator import MODES, SIM_POLICIES, SimConfig
from loraplex.daemon.sim.workload import ARRIVALS, LENGTHS, WorkloadSpec

# Workload flag -> WorkloadSpec field. The flags default to None ("not given") so that a given
# one can override a scenario's workload; unset ones keep the base spec's value.
WORKLOAD_FLAGS = {"seed": "seed", "duration": "duration_s", "max_requests": "max_requests", "arrival": "arrival",
                  "rate": "rate_rps", "cv": "cv", "adapters": "num_adapters", "zipf": "zipf_exponent",
                  "ranks": "ranks", "lengths": "lengths", "prompt_mean": "prompt_mean",
                  "output_mean": "output_mean", "trace": "trace", "time_scale": "time_scale"}

COMPARE_KEYS = {"policy": "policy", "cache_policy": "cache_policy", "cache-policy": "cache_policy",
                "mode": "mode", "router": "router"}
SHOWN = ("label", "slo_attainment", "mean_ttft_ms", "p99_ttft_ms", "mean_tpt_ms", "p99_tpt_ms",
         "throughput_rps", "goodput_rps", "cache_hit_rate", "pcie_bytes")


def add_workload_args(p: argparse.ArgumentParser) -> None:
    """The workload flags (defaults in brackets are WorkloadSpec's)."""
    w = WorkloadSpec()
    p.add_argument("--seed", type=int, help=f"workload seed [{w.seed}]")
    p.add_argument("--duration", type=float, help=f"seconds of arrivals [{w.duration_s:g}]")
    p.add_argument("--max-requests", type=int, help="stop after this many requests")
    p.add_argument("--arrival", choices=ARRIVALS, help=f"arrival process [{w.arrival}]")
    p.add_argument("--rate", type=float, help=f"arrival rate, req/s [{w.rate_rps:g}]")
    p.add_argument("--cv", type=float, help=f"gamma arrivals: coefficient of variation [{w.cv:g}]")
    p.add_argument("--adapters", type=int, help=f"number of adapters [{w.num_adapters}]")
    p.add_argument("--zipf", type=float, help=f"popularity exponent s: P(i) ∝ 1/i^s [{w.zipf_exponent:g}]")
    p.add_argument("--ranks", type=int, nargs="+", help=f"rank mix [{' '.join(map(str, w.ranks))}]")
    p.add_argument("--lengths", choices=LENGTHS, help=f"prompt/output lengths [{w.lengths}]")
    p.add_argument("--prompt-mean", type=int, help=f"median prompt tokens [{w.prompt_mean}]")
    p.add_argument("--output-mean", type=int, help=f"median output tokens [{w.output_mean}]")
    p.add_argument("--trace", help=f"conv | code | a CSV path (trace arrivals or lengths) [{w.trace}]")
    p.add_argument("--time-scale", type=float, help=f"trace arrivals: speed-up factor [{w.time_scale:g}]")


def workload_from_args(args: argparse.Namespace, base: WorkloadSpec | None = None) -> WorkloadSpec:
    """`base` (default WorkloadSpec()) with every workload flag that was given."""
    given = {field: getattr(args, flag) for flag, field in WORKLOAD_FLAGS.items() if getattr(args, flag) is not None}
    if "ranks" in given:
        given["ranks"] = tuple(given["ranks"])
    return dataclasses.replace(base or WorkloadSpec(), **given)


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--scenario", choices=sorted(SCENARIOS), help="run a named scenario")
    p.add_argument("--quick", action="store_true",
                   help="the scenario's quick preset: the same comparison on a smaller workload, in seconds")
    p.add_argument("--jobs", type=int, metavar="N",
                   help="simulations run side by side in N worker processes [the CPU cores this process may use]")
    p.add_argument("--compare", metavar="KEY=A,B,...",
                   help="run each value of KEY (policy, cache_policy, mode, router) on the same trace")
    p.add_argument("--rates", type=float, nargs="+", help="sweep these arrival rates (req/s)")
    p.add_argument("--json", action="store_true", help="print one JSON value on stdout")
    p.add_argument("--plot-dir", type=Path, help="write PNG plots here")
    p.add_argument("--decision-log", type=Path,
                   help="one run only: write its per-step decisions here, a JSON line each, in the format of the "
                        "daemon's server.decision_log")
    p.add_argument("--profile", type=Path, help="latency profile JSON (SimProfile fields; replaces a scenario's)")
    p.add_argument("--profile-set", action="append", default=[], metavar="FIELD=VALUE",
                   help="override one profile field, also a scenario's (repeatable; e.g. kernel=mbgmv)")
    d = SimConfig()
    p.add_argument("--policy", default=d.policy, help=f"scheduler: {' | '.join(SIM_POLICIES)}")
    p.add_argument("--cache-policy", default=d.cache_policy, help="none | lru | fifo | cost")
    p.add_argument("--mode", choices=MODES, default=d.mode)
    p.add_argument("--router", default=d.router)
    p.add_argument("--engines", type=int, default=d.num_engines)
    p.add_argument("--ttft-slo-ms", type=float, default=d.ttft_slo_ms)
    p.add_argument("--tpt-slo-ms", type=float, default=d.tpt_slo_ms)
    p.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=None,
                   help=f"plan each step while the one before runs, as scheduler.overlap (default {d.overlap}); "
                        "applies to every variant of a --scenario too")
    add_workload_args(p)


def _scenario(args: argparse.Namespace) -> Scenario:
    """The named scenario, with the workload flags and profile overrides that were given applied."""
    scenario = get(args.scenario)
    if args.quick:
        scenario = scenario.quick_preset()
    profile = SimProfile.load(args.profile) if args.profile else scenario.profile
    variants = scenario.variants
    if args.overlap is not None:
        variants = tuple((label, dataclasses.replace(config, overlap=args.overlap)) for label, config in variants)
    return dataclasses.replace(scenario, workload=workload_from_args(args, scenario.workload),
                               profile=profile.override(args.profile_set), variants=variants)


def _custom(args: argparse.Namespace) -> Scenario:
    workload = workload_from_args(args)
    config = SimConfig(policy=args.policy, cache_policy=args.cache_policy, mode=args.mode, router=args.router,
                       num_engines=args.engines, ttft_slo_ms=args.ttft_slo_ms, tpt_slo_ms=args.tpt_slo_ms,
                       overlap=SimConfig().overlap if args.overlap is None else args.overlap)
    profile = (SimProfile.load(args.profile) if args.profile else SimProfile()).override(args.profile_set)
    variants: tuple[tuple[str, SimConfig], ...] = ((config.policy, config),)
    if args.compare:
        key, _, values = args.compare.partition("=")
        field = COMPARE_KEYS.get(key)
        names = [v for v in values.split(",") if v]
        if field is None or not names:
            raise ValueError(f"--compare wants KEY=A,B,... with KEY one of {', '.join(COMPARE_KEYS)}")
        variants = tuple((v, dataclasses.replace(config, **{field: v})) for v in names)
    return Scenario("custom", "from the command line", workload, profile, variants)


def run(args: argparse.Namespace) -> int:
    try:
        if args.quick and not args.scenario:
            raise ValueError("--quick scales down a --scenario")
        if args.jobs is not None and args.jobs < 1:
            raise ValueError("--jobs must be at least 1")
        scenario = _scenario(args) if args.scenario else _custom(args)
        rates = args.rates or list(scenario.rates)
        if args.decision_log and (rates or len(scenario.variants) > 1):
            raise ValueError("--decision-log records one run: not with --compare, --rates or a multi-variant scenario")
        workers = args.jobs or default_workers()
        progress = Progress("sim", runs_per_rate(scenario) * max(1, len(rates)))
        if rates:
            # The CDF plots show the highest rate: its runs are kept whole (made in this process).
            rows, results = sweep(scenario, rates, workers=workers, progress=progress, keep_highest=bool(args.plot_dir))
        else:
            keep = bool(args.plot_dir or args.decision_log)  # both need whole runs, made in this process
            rows, results = run_variants(scenario, workers=workers, progress=progress, keep_results=keep)
            if args.decision_log:
                (result,) = results.values()
                write_decisions(args.decision_log, (StepDecision(d.engine, d.step_id, d.admitted, d.rows,
                                                                 d.merged_adapter) for d in result.decisions))
        progress.finish(f" ({workers} worker{'s' if workers > 1 else ''})")
    except (ValueError, OSError, RuntimeError) as exc:
        print(f"loraplex sim: error: {exc}", file=sys.stderr)
        return 2
    plots: list[str] = []
    if args.plot_dir:
        from loraplex.daemon.sim.plots import plot_cdfs, plot_vs_load

        stem = scenario.name
        plots.append(str(plot_cdfs(results, args.plot_dir / f"{stem}-ttft-cdf.png", "ttft")))
        plots.append(str(plot_cdfs(results, args.plot_dir / f"{stem}-tpt-cdf.png", "tpt")))
        if rates:
            plots.append(str(plot_vs_load(rows, args.plot_dir / f"{stem}-p99-ttft-vs-load.png")))
    compared = len(scenario.variants) > 1 and not rates
    if args.json:
        if args.scenario:
            out: object = rows
        elif args.compare or rates:
            out = {"rows": rows, "ratios": ratios(rows) if compared else None, "plots": plots}
        else:
            out = {**rows[0], "plots": plots}
        print(json.dumps(out, allow_nan=False))
        return 0
    shown = ("rate_rps", *SHOWN) if rates else SHOWN
    print(f"{scenario.name}: {scenario.description}")
    print(format_table(rows, shown))
    if compared:
        print(f"\nratios to {rows[0]['label']}:")
        print(format_table(ratios(rows), ("label", *SHOWN[1:-1])))
    for path in plots:
        print(f"wrote {path}")
    return 0
