"""`loraplex sim`: arguments and output of the simulator command (torch-free).

A named scenario (--scenario), or one run / a comparison (--compare KEY=a,b,c) on a
workload built from the flags; --rates sweeps load; --json prints one JSON value on stdout
(an object for a single run or comparison, a list of rows for a scenario); --plot-dir
writes PNGs (TTFT CDFs, and latency vs load when --rates is given).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from loraplex.daemon.sim.metrics import format_table, ratios, summarize
from loraplex.daemon.sim.profile import SimProfile
from loraplex.daemon.sim.scenarios import SCENARIOS, Scenario, get, run_variants, sweep
from loraplex.daemon.sim.simulator import MODES, SimConfig
from loraplex.daemon.sim.workload import ARRIVALS, LENGTHS, WorkloadSpec

COMPARE_KEYS = {"policy": "policy", "cache_policy": "cache_policy", "cache-policy": "cache_policy",
                "mode": "mode", "router": "router"}
SHOWN = ("label", "slo_attainment", "mean_ttft_ms", "p99_ttft_ms", "mean_tpt_ms", "p99_tpt_ms",
         "throughput_rps", "goodput_rps", "cache_hit_rate", "pcie_bytes")


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--scenario", choices=sorted(SCENARIOS), help="run a named scenario")
    p.add_argument("--compare", metavar="KEY=A,B,...",
                   help="run each value of KEY (policy, cache_policy, mode, router) on the same trace")
    p.add_argument("--rates", type=float, nargs="+", help="sweep these arrival rates (req/s)")
    p.add_argument("--json", action="store_true", help="print one JSON value on stdout")
    p.add_argument("--plot-dir", type=Path, help="write PNG plots here")
    p.add_argument("--profile", type=Path, help="latency profile JSON (SimProfile fields)")
    d, w = SimConfig(), WorkloadSpec()
    p.add_argument("--policy", default=d.policy, help="scheduler: fcfs | mlq | dlora")
    p.add_argument("--cache-policy", default=d.cache_policy, help="none | lru | fifo | cost")
    p.add_argument("--mode", choices=MODES, default=d.mode)
    p.add_argument("--router", default=d.router)
    p.add_argument("--engines", type=int, default=d.num_engines)
    p.add_argument("--ttft-slo-ms", type=float, default=d.ttft_slo_ms)
    p.add_argument("--tpt-slo-ms", type=float, default=d.tpt_slo_ms)
    p.add_argument("--seed", type=int, default=w.seed)
    p.add_argument("--duration", type=float, default=w.duration_s, help="seconds of arrivals")
    p.add_argument("--max-requests", type=int, default=None)
    p.add_argument("--arrival", choices=ARRIVALS, default=w.arrival)
    p.add_argument("--rate", type=float, default=w.rate_rps, help="arrival rate, req/s")
    p.add_argument("--cv", type=float, default=w.cv, help="gamma arrivals: coefficient of variation")
    p.add_argument("--adapters", type=int, default=w.num_adapters)
    p.add_argument("--zipf", type=float, default=w.zipf_exponent, help="popularity exponent s: P(i) ∝ 1/i^s")
    p.add_argument("--ranks", type=int, nargs="+", default=list(w.ranks))
    p.add_argument("--lengths", choices=LENGTHS, default=w.lengths)
    p.add_argument("--prompt-mean", type=int, default=w.prompt_mean)
    p.add_argument("--output-mean", type=int, default=w.output_mean)
    p.add_argument("--trace", default=w.trace, help="conv | code | a CSV path (trace arrivals or lengths)")
    p.add_argument("--time-scale", type=float, default=w.time_scale, help="trace arrivals: speed-up factor")


def _custom(args: argparse.Namespace) -> Scenario:
    workload = WorkloadSpec(seed=args.seed, duration_s=args.duration, max_requests=args.max_requests,
                            arrival=args.arrival, rate_rps=args.rate, cv=args.cv, num_adapters=args.adapters,
                            zipf_exponent=args.zipf, ranks=tuple(args.ranks), lengths=args.lengths,
                            prompt_mean=args.prompt_mean, output_mean=args.output_mean, trace=args.trace,
                            time_scale=args.time_scale)
    config = SimConfig(policy=args.policy, cache_policy=args.cache_policy, mode=args.mode, router=args.router,
                       num_engines=args.engines, ttft_slo_ms=args.ttft_slo_ms, tpt_slo_ms=args.tpt_slo_ms)
    profile = SimProfile.load(args.profile) if args.profile else SimProfile()
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
        scenario = get(args.scenario) if args.scenario else _custom(args)
        if args.rates:
            rows = sweep(scenario, args.rates)
            results = run_variants(scenario, dataclasses.replace(scenario.workload, rate_rps=max(args.rates)))[1]
        else:
            rows, results = run_variants(scenario)
    except (ValueError, OSError) as exc:
        print(f"loraplex sim: {exc}")
        return 2
    plots: list[str] = []
    if args.plot_dir:
        from loraplex.daemon.sim.plots import plot_cdfs, plot_vs_load

        stem = scenario.name
        plots.append(str(plot_cdfs(results, args.plot_dir / f"{stem}-ttft-cdf.png", "ttft")))
        plots.append(str(plot_cdfs(results, args.plot_dir / f"{stem}-tpt-cdf.png", "tpt")))
        if args.rates:
            plots.append(str(plot_vs_load(rows, args.plot_dir / f"{stem}-p99-ttft-vs-load.png")))
    compared = len(scenario.variants) > 1 and not args.rates
    if args.json:
        if args.scenario:
            out: object = rows
        elif args.compare or args.rates:
            out = {"rows": rows, "ratios": ratios(rows) if compared else None, "plots": plots}
        else:
            out = {**rows[0], "plots": plots}
        print(json.dumps(out, allow_nan=False))
        return 0
    shown = ("rate_rps", *SHOWN) if args.rates else SHOWN
    print(f"{scenario.name}: {scenario.description}")
    print(format_table(rows, shown))
    if compared:
        print(f"\nratios to {rows[0]['label']}:")
        print(format_table(ratios(rows), ("label", *SHOWN[1:-1])))
    for path in plots:
        print(f"wrote {path}")
    return 0
