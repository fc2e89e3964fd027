"""Stage `cpu-many-core`: the CPU side of cpu_assist on the GPU host's cores.

- worker processes vs one process with as many torch intra-op threads, for the
  same LoRA work (bench/cpu_lora_compute.py; Toppings Fig. 17 target >= 1.4x);
- the per-layer invocation round trip from the engine to N workers over shared
  memory words and futexes, N = 1, 4, 8, 16 (bench/ipc_roundtrip.py; flat in N).
"""
from __future__ import annotations

import os

from .harness import StageContext
from .plan import Step

STAGE = "cpu-many-core"

WORKERS_OVER_THREADS_TARGET = 1.4  # Toppings Fig. 17
FLATNESS_TARGET = 2.0  # p50 round trip at the most workers over one worker: "flat in N" (ours)


def workers_vs_threads(ctx: StageContext) -> None:
    args = ["--small"] if ctx.dry_run else []
    report = ctx.run("workers_vs_threads", ["cpu_lora_compute.py", "--json", *args], est_s=20 if ctx.dry_run else 240)
    if report is not None:
        s = report["summary"]
        ctx.figures["workers_vs_threads"] = {"workers": report["config"]["workers"],
                                             "ratio_geomean": s["ratio_geomean"],
                                             "ratio_min": s["ratio_min"], "ratio_max": s["ratio_max"],
                                             "by_case": {f"r{r['rank']}/{r['prompt_len']}": round(r["ratio"], 3)
                                                         for r in report["parallel"]}}
        ctx.target(f"threads time / worker processes time, geomean ({report['config']['workers']} cores)",
                   s["ratio_geomean"], WORKERS_OVER_THREADS_TARGET, ">=", "Toppings Fig. 17")


def round_trip(ctx: StageContext) -> None:
    cores = len(os.sched_getaffinity(0))
    wanted = [1, 2] if ctx.dry_run else [n for n in (1, 4, 8, 16) if n <= cores] or [1]
    iters = ["--iters", "200"] if ctx.dry_run else ["--iters", "2000"]
    trip = ctx.run("round_trip", ["ipc_roundtrip.py", "--json", "--variants", "shm_futex", "--receivers",
                                  *map(str, wanted), *iters], est_s=15 if ctx.dry_run else 90)
    if trip is not None:
        p50 = {r["receivers"]: r["p50_us"] for r in trip["results"]}
        p99 = {r["receivers"]: r["p99_us"] for r in trip["results"]}
        ctx.figures["round_trip_us"] = {"p50": p50, "p99": p99, "cores": cores}
        most = max(p50)
        ctx.target(f"round trip p50 with {most} workers / with 1", p50[most] / p50[min(p50)], FLATNESS_TARGET, "<=",
                   "Toppings Fig. 12: flat in N (our bar: within 2x)")


def steps() -> list[Step]:
    """This stage's steps, in the order a stage run takes them (tiers: gpu_stages.plan)."""
    return [Step(STAGE, "workers_vs_threads", 4, 240, workers_vs_threads, order=4),
            Step(STAGE, "round_trip", 4, 90, round_trip, order=5)]


def run(ctx: StageContext) -> None:
    for step in steps():
        step.run(ctx)
