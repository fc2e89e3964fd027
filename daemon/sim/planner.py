"""`loraplex plan`: how many engines a workload needs to meet its SLOs (torch-free).

The simulator serves the same trace with 1, 2, 4, ... engines until the SLO attainment
target is met (or --max-engines is reached), then binary-searches between the last N that
missed and the first that met it. The search assumes attainment does not fall when engines
are added; every N tried stays in the table, so a workload where that fails shows it.
Progress goes to stderr (each engine count tried, and the simulation under way with an
estimate of its time left); the answer (or --json) to stdout. Never sleeps; only the
progress line reads a clock.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from loraplex.daemon.sim.cli import add_workload_args, workload_from_args
from loraplex.daemon.sim.metrics import format_table, summarize
from loraplex.daemon.sim.profile import SimProfile
from loraplex.daemon.sim.progress import Progress
from loraplex.daemon.sim.simulator import MODES, SIM_POLICIES, SimConfig, simulate
from loraplex.daemon.sim.workload import RequestEvent, WorkloadSpec, generate

# The per-N table: what the planner reports for every engine count it simulated.
TABLE_KEYS = ("engines", "slo_attainment", "p99_ttft_ms", "mean_ttft_ms", "mean_tpt_ms", "p99_tpt_ms",
              "throughput_rps", "goodput_rps", "completed", "aborted")


@dataclass(frozen=True, slots=True)
class PlanSpec:
    config: SimConfig  # scheduler, router, SLOs, ...; num_engines is what the planner varies
    target_attainment: float = 0.99  # fraction of requests that must meet both SLOs
    max_engines: int = 64

    def __post_init__(self) -> None:
        if not 0 < self.target_attainment <= 1:
            raise ValueError(f"target attainment must be in (0, 1], got {self.target_attainment!r}")
        if self.max_engines < 1:
            raise ValueError(f"max engines must be at least 1, got {self.max_engines!r}")


@dataclass(frozen=True, slots=True)
class PlanResult:
    engines: int | None  # the fewest engines that met the target; None: none up to max_engines did
    spec: PlanSpec
    table: tuple[dict[str, object], ...]  # one row per engine count simulated, by count

    def to_dict(self) -> dict[str, object]:
        c = self.spec.config
        return {"engines": self.engines, "met": self.engines is not None,
                "target_attainment": self.spec.target_attainment, "max_engines": self.spec.max_engines,
                "slo_ttft_ms": c.ttft_slo_ms, "slo_tpt_ms": c.tpt_slo_ms, "scheduler": c.policy, "router": c.router,
                "cache_policy": c.cache_policy, "mode": c.mode, "table": list(self.table)}


def plan(events: list[RequestEvent], spec: PlanSpec, profile: SimProfile | None = None,
         progress: Callable[[dict[str, object]], None] | None = None, runs: Progress | None = None) -> PlanResult:
    """Search the fewest engines serving `events` at the target attainment; `progress` gets
    each table row as it is simulated, `runs` the progress of each simulation."""
    if not events:
        raise ValueError("the workload has no requests")
    rows: dict[int, dict[str, object]] = {}

    def meets(n: int) -> bool:
        run = len(rows)
        if runs is not None:
            runs.start(run, f"{n} engine{'s' if n > 1 else ''}")
        result = simulate(events, dataclasses.replace(spec.config, num_engines=n), profile,
                          progress=None if runs is None else lambda share: runs.update(run, share))
        if runs is not None:
            runs.done(run)
        row = summarize(result)
        entry = {k: row[k] for k in TABLE_KEYS}
        entry["meets"] = float(row["slo_attainment"]) >= spec.target_attainment  # type: ignore[arg-type]
        rows[n] = entry
        if progress is not None:
            progress(entry)
        return bool(entry["meets"])

    missed, found, n = 0, None, 1  # 0 engines serve nothing: a miss by definition
    while True:  # exponential phase
        if meets(n):
            found = n
            break
        missed = n
        if n >= spec.max_engines:
            break
        n = min(2 * n, spec.max_engines)
    while found is not None and found - missed > 1:  # binary phase: missed < answer <= found
        mid = (missed + found) // 2
        if meets(mid):
            found = mid
        else:
            missed = mid
    return PlanResult(found, spec, tuple(rows[k] for k in sorted(rows)))


# ---- the command -------------------------------------------------------------------------------
def configure(p: argparse.ArgumentParser) -> None:
    d = SimConfig()
    p.add_argument("--slo-tpt-ms", type=float, required=True, help="time-per-output-token SLO, ms")
    p.add_argument("--slo-ttft-ms", type=float, default=d.ttft_slo_ms,
                   help=f"time-to-first-token SLO, ms [{d.ttft_slo_ms:g}]")
    p.add_argument("--target-attainment", type=float, default=0.99,
                   help="fraction of requests that must meet both SLOs [0.99]")
    p.add_argument("--max-engines", type=int, default=64, help="largest engine count to try [64]")
    p.add_argument("--router", default=d.router, help=f"engine router [{d.router}]")
    p.add_argument("--scheduler", default=d.policy, help=f"{' | '.join(SIM_POLICIES)} [{d.policy}]")
    p.add_argument("--cache-policy", default=d.cache_policy, help=f"none | lru | fifo | cost [{d.cache_policy}]")
    p.add_argument("--mode", choices=MODES, default=d.mode, help=f"adapter loading [{d.mode}]")
    p.add_argument("--profile", type=Path, help="latency profile JSON (SimProfile fields) [built-in defaults]")
    p.add_argument("--profile-set", action="append", default=[], metavar="FIELD=VALUE",
                   help="override one profile field (repeatable; e.g. kernel=bgmv)")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.add_argument("--serve-config", type=Path, default=None, metavar="FILE",
                   help="also write a Ray Serve config deploying the engine count found as loraplex cluster "
                        "replicas (one engine each; `serve deploy FILE`)")
    add_workload_args(p)  # --trace alone replays the trace's arrivals and lengths


def _workload(args: argparse.Namespace) -> WorkloadSpec:
    if args.trace is not None:  # a trace given without saying what to take from it: take both
        args = argparse.Namespace(**{**vars(args), "arrival": args.arrival or "trace",
                                     "lengths": args.lengths or "trace"})
    return workload_from_args(args)


def run(args: argparse.Namespace) -> int:
    def say(row: dict[str, object]) -> None:
        verdict = "meets" if row["meets"] else "misses"
        print(f"plan: {row['engines']} engine(s): attainment {row['slo_attainment']:.4f} {verdict} the target, "
              f"p99 TTFT {row['p99_ttft_ms']:.1f} ms, mean TPT {row['mean_tpt_ms']:.2f} ms", file=sys.stderr)

    try:
        workload = _workload(args)
        config = SimConfig(policy=args.scheduler, cache_policy=args.cache_policy, mode=args.mode, router=args.router,
                           ttft_slo_ms=args.slo_ttft_ms, tpt_slo_ms=args.slo_tpt_ms)
        spec = PlanSpec(config, target_attainment=args.target_attainment, max_engines=args.max_engines)
        profile = (SimProfile.load(args.profile) if args.profile else SimProfile()).override(args.profile_set)
        events = generate(workload)
        print(f"plan: {len(events)} requests over {workload.duration_s:g} s; searching 1..{spec.max_engines} "
              f"engines for {spec.target_attainment:.2%} attainment", file=sys.stderr)
        runs = Progress("plan", None)
        result = plan(events, spec, profile, progress=say, runs=runs)
        runs.finish()
    except (ValueError, OSError, RuntimeError) as exc:
        print(f"loraplex plan: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        out = {**result.to_dict(), "requests": len(events), "workload": dataclasses.asdict(workload),
               "profile": profile.to_dict()}
        print(json.dumps(out, allow_nan=False))
    else:
        print(format_table(list(result.table), (*TABLE_KEYS[:-2], "meets")))
    if result.engines is None:
        best = max(float(r["slo_attainment"]) for r in result.table)  # type: ignore[arg-type]
        print(f"loraplex plan: no engine count up to {spec.max_engines} reaches {spec.target_attainment:.2%} "
              f"SLO attainment (best: {best:.2%}); raise --max-engines or relax the SLOs", file=sys.stderr)
        return 1
    if args.serve_config is not None:
        from loraplex.cluster.config import ClusterConfig, serve_config  # ray-free; only when asked

        cluster = ClusterConfig(replicas=result.engines)
        args.serve_config.write_text(json.dumps(serve_config(cluster), indent=2) + "\n")
        print(f"plan: wrote a Serve config for {result.engines} replica(s) to {args.serve_config}", file=sys.stderr)
    if not args.json:
        print(f"{result.engines} engine(s) meet {spec.target_attainment:.2%} attainment "
              f"(TTFT <= {config.ttft_slo_ms:g} ms, TPT <= {config.tpt_slo_ms:g} ms)")
    return 0
