"""Stage `kernels`: bench/kernels.py at real size (BGMV/MBGMV bandwidth over the
measured copy bandwidth and over gather + bmm, SGMV, paged attention decode and
prefill against their roofline and torch's fused SDPA), then the BGMV/MBGMV
decode-step perf models fitted on a Llama-2-7B-shaped model (bench/decode_profile.py)
and written as the profile `scheduler.router_profile` loads.
"""
from __future__ import annotations

from typing import Any

from .harness import StageContext
from .plan import Step

STAGE = "kernels"

PROFILE_FILE = "router_profile.json"


def gemv_figures(report: dict[str, Any]) -> dict[str, Any]:
    """At the largest batch with mixed ranks: each kernel's share of copy bandwidth and speed-up over
    torch's gather + bmm."""
    rows = report["gemv"]
    batch = max(r["batch"] for r in rows)
    row = next((r for r in rows if r["batch"] == batch and r["rank"] == "mixed"), rows[-1])
    return {"batch": batch, "rank": row["rank"], "copy_gb_s": report["copy_gb_s"],
            "bgmv_frac_of_copy": row["bgmv_frac_of_copy"], "mbgmv_frac_of_copy": row["mbgmv_frac_of_copy"],
            "bgmv_speedup_over_gather_bmm": row["torch_s"] / row["bgmv_s"],
            "mbgmv_speedup_over_gather_bmm": row["torch_s"] / row["mbgmv_s"],
            "bgmv_frac_of_copy_by_batch": {f"{r['batch']}/{r['rank']}": round(r["bgmv_frac_of_copy"], 3)
                                           for r in rows}}


def attention_figures(rows: list[dict[str, Any]], key: str) -> list[dict[str, Any]]:
    return [{"case": "x".join(str(r[k]) for k in key.split(",")), "ms": r["s"] * 1e3,
             "frac_of_roofline": r["frac_of_roofline"], "paged_over_sdpa": r["paged_over_sdpa"]} for r in rows]


def kernels_bench(ctx: StageContext) -> None:
    args = ["--device", "cpu", "--interpret", "--small"] if ctx.dry_run else ["--device", "cuda"]
    report = ctx.run("kernels_bench", ["kernels.py", "--json", *args], est_s=30 if ctx.dry_run else 45)
    if report is not None:
        gemv = gemv_figures(report)
        decode = attention_figures(report["attention_decode"], "batch,context")
        prefill = attention_figures(report["attention_prefill"], "seqs,prompt")
        ctx.figures.update(gemv=gemv, sgmv_tflop_s=[r["sgmv_tflop_s"] for r in report["sgmv"]],
                           attention_decode=decode, attention_prefill=prefill,
                           matmul_tflop_s=report["matmul_tflop_s"], timings_meaningful=report["env"][
                               "timings_meaningful"])
        ctx.target("BGMV share of copy bandwidth (batch 64, mixed ranks)", gemv["bgmv_frac_of_copy"], 0.5, ">=",
                   "Punica: BGMV close to memory bandwidth (our bar: half the measured copy)")
        ctx.target("BGMV speed-up over gather + bmm", gemv["bgmv_speedup_over_gather_bmm"], 1.0, ">=", "ours")
        ctx.target("paged decode attention time / SDPA on contiguous KV (worst case)",
                   max(r["paged_over_sdpa"] for r in decode), 1.5, "<=", "ours: the pool's paging costs < 50%")


def perf_models(ctx: StageContext) -> None:
    profile = ctx.out / PROFILE_FILE
    shape = ["--shape", "tiny", "--batches", "1", "3", "--ranks", "4", "8", "--distinct", "3", "--fit-distinct", "2",
             "--steps", "2", "--context", "8"] if ctx.dry_run else ["--shape", "7b", "--backend", "triton"]
    fit = ctx.run("perf_models", ["decode_profile.py", "--json", "--profile-out", str(profile), *shape],
                  est_s=20 if ctx.dry_run else 130)
    if fit is not None:
        ctx.figures["perf_models"] = {k: {m: round(v, 5) for m, v in f.items()} for k, f in fit["fits"].items()}
        for kernel in ("bgmv", "mbgmv"):
            ctx.target(f"PERF_{kernel.upper()} fit R²", fit["fits"][kernel]["r2"], 0.9, ">=",
                       "Toppings §5: the rank-aware router's step-time model")
        ctx.call("profile_loads", lambda: load_profile(profile))


def steps() -> list[Step]:
    """This stage's steps, in the order a stage run takes them (tiers: gpu_stages.plan)."""
    return [Step(STAGE, "kernels_bench", 3, 45, kernels_bench, order=2),
            Step(STAGE, "perf_models", 4, 130, perf_models, order=1)]


def run(ctx: StageContext) -> None:
    for step in steps():
        step.run(ctx)


def load_profile(path) -> dict[str, Any]:
    """The written file loads as the router's PerfProfile (as scheduler.router_profile does)."""
    from loraplex.daemon.router.rank_aware import PerfProfile

    profile = PerfProfile.load(path)
    return {"path": path.name, "bgmv_r2": profile.bgmv.r2, "mbgmv_r2": profile.mbgmv.r2}
