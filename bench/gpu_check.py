"""GPU validation in four stages, each sized for one short device call (<= 8 min on
one H100): `build-test`, `kernels`, `e2e`, `cpu-many-core` (or `all`).

Each stage writes `<out>/<stage>.json` (stage, device, ok, seconds, items with
their status and reason, figures, targets) and appends its part to
`<out>/summary.md`. `--dry-run` runs every stage on the CPU at toy size through
the same code, CUDA-only items reported as skipped with their reason; the suite
runs it so the harness cannot rot. Exit status: 0 when every stage run was ok,
1 when an item failed, 2 for bad usage or no CUDA device without --dry-run. The exact device commands are in
bench/README.md ("GPU validation"); `bench/gpu_report.py` renders the JSON into
bench/RESULTS.md.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from gpu_stages import STAGES, build_test, cpu_many_core, e2e, kernel_figures
from gpu_stages.harness import StageContext, device_info, log
from gpu_stages.summary import stage_markdown

DEFAULT_BUDGET_S = 450.0  # per stage: 7.5 min, inside an 8-min device call with start-up to spare


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--stage", choices=(*STAGES, "all"), required=True)
    p.add_argument("--out", type=Path, required=True, help="folder for <stage>.json and summary.md")
    p.add_argument("--dry-run", action="store_true", help="toy sizes on the CPU; CUDA-only items skipped")
    p.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S, help="time budget of each stage")
    p.add_argument("--install", action="store_true",
                   help="first `pip install -e .` (no deps, no index) unless this checkout is installed: builds "
                        "the extension on this host")
    args = p.parse_args(argv)
    if args.budget_s <= 0:
        p.error("--budget-s must be positive")
    return args


def run_stage(stage: str, args: argparse.Namespace, info: dict) -> dict:
    device = "cuda" if info.get("cuda_available") and not args.dry_run else "cpu"
    ctx = StageContext(stage=stage, out=args.out, dry_run=args.dry_run, device=device, budget_s=args.budget_s)
    log(f"[{stage}] on {info.get('name')} ({device}), budget {args.budget_s:.0f} s")
    if args.install:
        build_test.install(ctx)
    if stage == "build-test":
        build_test.run(ctx)
    elif stage == "kernels":
        kernel_figures.run(ctx)
    elif stage == "e2e":
        e2e.run(ctx)
    else:
        cpu_many_core.run(ctx)
    report = ctx.report(info)
    (args.out / f"{stage}.json").write_text(json.dumps(report, indent=1, allow_nan=False) + "\n")
    with (args.out / "summary.md").open("a") as summary:
        summary.write(stage_markdown(report) + "\n")
    log(f"[{stage}] {'ok' if report['ok'] else 'FAILED: ' + ', '.join(report['failed'])} in {report['seconds']:.0f} s")
    return report


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    info = device_info(args.dry_run)
    if not args.dry_run and not info.get("cuda_available"):
        log(f"no CUDA device here ({info.get('probe_error') or info.get('name')}): use --dry-run on a CPU host")
        return 2
    stages = STAGES if args.stage == "all" else (args.stage,)
    reports = [run_stage(stage, args, info) for stage in stages]
    return 0 if all(r["ok"] for r in reports) else 1


if __name__ == "__main__":
    sys.exit(main())
