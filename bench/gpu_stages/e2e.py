"""Stage `e2e`: random-weight models of Llama-2-7B and Llama-3-8B (GQA) dimensions
built on the device (load format dummy: nothing downloaded).

Steps (their tiers in `steps()`; gpu_stages.plan orders them in a window):
- the decode step with 64 distinct adapters over base-only, CUDA graphs on and
  off (bench/decode_profile.py --no-fit);
- adapter load time over bytes / measured pinned H2D bandwidth (bench/adapter_load.py);
- TTFT of cached vs on_demand vs cpu_assist at a Poisson load, 100 adapters of
  ranks 8-128 in the host store (bench/load_modes.py, one daemon per mode);
- the same decode step and TTFT comparison on the GQA shape.
Dry run: the tiny shape on the CPU through the same scripts.
"""
from __future__ import annotations

from typing import Any

from .harness import StageContext
from .plan import Step

STAGE = "e2e"

DECODE_OVERHEAD_TARGET_PCT = 15.0  # bench/decode_profile.py: unmerged LoRA over base, 64 adapters


def ttft(ctx: StageContext, shape: str, *, duration: float, rate: float, est_s: float) -> None:
    shape = "tiny" if ctx.dry_run else shape
    if ctx.dry_run:
        args = ["--shape", "tiny", "--device", "cpu", "--adapters", "6", "--rate", "8", "--duration", "1.5",
                "--prompt-mean", "16", "--output-mean", "4", "--max-prompt", "64", "--max-output", "16",
                "--cpu-workers", "2"]
    else:
        # 100 adapters (~21 GB at 7B): the cached mode loads them all before it is ready (146 s for 200
        # in the first window), and the three modes must fit one window
        args = ["--shape", shape, "--device", "cuda", "--adapters", "100", "--rate", str(rate),
                "--duration", str(duration), "--cpu-workers", "8"]
    name = f"ttft_{shape}"
    report = ctx.run(name, ["load_modes.py", "--json", *args], est_s=25 if ctx.dry_run else est_s)
    if report is None:
        return
    modes = {m: {"mean_ms": r["ttft_ms"]["mean"], "p99_ms": r["ttft_ms"]["p99"], "completed": r["completed"],
                 "requests": r["requests"], "hit_rate": r["hit_rate"], "ready_s": r["ready_s"]}
             for m, r in report["modes"].items()}
    ctx.figures[name] = {"modes": modes, "ratios": report["ratios"], "adapters": report["config"]["adapters"],
                         "adapter_gb": round(report["config"]["adapter_bytes"] / 1e9, 2), "rate_rps": rate}
    ratio = report["ratios"].get("cpu_assist_over_on_demand_mean")
    ctx.target(f"{shape}: cpu_assist mean TTFT / on_demand", ratio, 1.0, "<=",
               "Toppings: CPU-assisted prefill hides the cold load")
    lost = [m for m, r in modes.items() if r["completed"] < r["requests"]]
    if lost:
        ctx.items[-1].status, ctx.items[-1].reason = "failed", f"requests not completed in {lost}"


def decode(ctx: StageContext, shape: str, graphs: str, est_s: float) -> dict[str, Any] | None:
    shape = "tiny" if ctx.dry_run else shape
    name = f"decode_{shape}_graphs_{graphs}"
    if graphs == "on" and not ctx.needs_cuda(name, "CUDA graphs need a CUDA device"):
        return None
    args = ["--shape", "tiny", "--distinct", "3", "--batches", "3", "--steps", "2", "--context", "8"] \
        if ctx.dry_run else ["--shape", shape, "--backend", "triton", "--distinct", "64", "--batches", "64"]
    report = ctx.run(name, ["decode_profile.py", "--json", "--no-fit", "--cuda-graphs", graphs, *args],
                     est_s=15 if ctx.dry_run else est_s)
    if report is None:
        return None
    o = report["overhead"]
    ctx.figures[name] = {"batch": o["batch"], "distinct_adapters": o["distinct_adapters"], "rank": o["rank"],
                         "base_step_ms": o["base_step_ms"], "lora_step_ms": o["lora_step_ms"],
                         "overhead_pct": o["overhead_pct"], "cuda_graphs": report.get("cuda_graphs")}
    ctx.target(f"{shape}: decode step over base, {o['distinct_adapters']} adapters, graphs {graphs} (%)",
               o["overhead_pct"], DECODE_OVERHEAD_TARGET_PCT, "<=", "Toppings/S-LoRA: unmerged LoRA overhead")
    return o


def adapter_load(ctx: StageContext) -> None:
    shape = "tiny" if ctx.dry_run else "7b"
    args = ["--ranks", "8", "16", "--repeats", "2", "--h2d-mib", "4"] if ctx.dry_run else []
    name = f"adapter_load_{shape}"
    report = ctx.run(name, ["adapter_load.py", "--json", "--shape", shape, *args], est_s=10 if ctx.dry_run else 15)
    if report is None:
        return
    ctx.figures[name] = {"h2d_gb_s": report["h2d_gb_s"], "pinned": report["pinned"],
                                      "by_rank": {r["rank"]: {"mb": round(r["bytes"] / 1e6, 1),
                                                              "ms": round(r["load_s"] * 1e3, 3),
                                                              "over_link": round(r["ratio"], 2)}
                                                  for r in report["loads"]}}
    worst = max(r["ratio"] for r in report["loads"])
    ctx.target(f"{shape}: adapter load time / (bytes / pinned H2D bandwidth), worst rank", worst, 1.5, "<=",
               "ours: a load runs near the link's speed")


def graphs_speedup(ctx: StageContext) -> None:
    off, on = ctx.figures.get("decode_7b_graphs_off"), ctx.figures.get("decode_7b_graphs_on")
    if off and on:
        ctx.figures["graphs_speedup_7b"] = {"base": off["base_step_ms"] / on["base_step_ms"],
                                            "lora": off["lora_step_ms"] / on["lora_step_ms"]}


def decode_7b(graphs: str):
    def run_decode(ctx: StageContext) -> None:
        decode(ctx, "7b", graphs, est_s=30)
        graphs_speedup(ctx)
    return run_decode


def dry_or(name: str, fn):
    """On a dry run the tiny shape already ran the same path: the 8B step is skipped."""
    def run_or_skip(ctx: StageContext) -> None:
        if ctx.dry_run:
            ctx.skip(name, "dry run: the tiny shape already ran the same path")
        else:
            fn(ctx)
    return run_or_skip


def steps() -> list[Step]:
    """This stage's steps, in the order a stage run takes them (tiers: gpu_stages.plan)."""
    return [Step(STAGE, "decode_7b_graphs_on", 3, 30, decode_7b("on"), order=0),
            Step(STAGE, "adapter_load_7b", 3, 15, adapter_load, order=1),
            Step(STAGE, "ttft_7b", 3, 200, lambda ctx: ttft(ctx, "7b", duration=15, rate=4.0, est_s=200), order=4),
            Step(STAGE, "decode_7b_graphs_off", 4, 30, decode_7b("off"), order=0),
            Step(STAGE, "decode_8b_graphs_on", 4, 35, dry_or("decode_8b_graphs_on",
                                                              lambda ctx: decode(ctx, "8b", "on", est_s=35)), order=2),
            Step(STAGE, "ttft_8b", 4, 200, dry_or("ttft_8b", lambda ctx: ttft(ctx, "8b", duration=15, rate=4.0,
                                                                            est_s=200)), order=3)]


def run(ctx: StageContext) -> None:
    for step in steps():
        step.run(ctx)
