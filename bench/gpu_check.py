"""GPU validation in four stages: `build-test`, `kernels`, `e2e`, `cpu-many-core`
(or `all`), each within `--budget-s`; or `--window S`: every stage's steps as one
plan for a single device call of S seconds, most valuable first (build, then
correctness, then the headline figures, then the rest: gpu_stages/plan.py).
`--rest-of DIR` runs, in a second call, what a first call (its JSON in DIR)
did not reach, and writes both calls' results.

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
from gpu_stages.harness import Item, StageContext, Target, device_info, log
from gpu_stages.plan import TIERS, Step, ordered, plan_table
from gpu_stages.summary import stage_markdown

DEFAULT_BUDGET_S = 450.0  # per stage: 7.5 min, inside an 8-min device call with start-up to spare
MODULES = {"build-test": build_test, "kernels": kernel_figures, "e2e": e2e, "cpu-many-core": cpu_many_core}
MAX_WINDOW_S = 600.0  # one device call's limit
WINDOW_CAP_FACTOR = 3.0  # a window's child runs at most 3x its estimate (StageContext.cap_factor)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--stage", choices=(*STAGES, "all"))
    which.add_argument("--window", type=float, metavar="S",
                       help="every stage's steps in one call of S seconds, most valuable first")
    p.add_argument("--rest-of", type=Path, metavar="DIR",
                   help="with --window: skip the steps a first call (its stage JSON in DIR) ran; keep its results")
    p.add_argument("--plan", action="store_true", help="with --window: print the plan as JSON and run nothing")
    p.add_argument("--out", type=Path, required=True, help="folder for <stage>.json and summary.md")
    p.add_argument("--dry-run", action="store_true", help="toy sizes on the CPU; CUDA-only items skipped")
    p.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S, help="time budget of each stage")
    p.add_argument("--install", action="store_true",
                   help="first `pip install -e .` (no deps, no index) unless this checkout is installed: builds "
                        "the extension on this host")
    args = p.parse_args(argv)
    if args.budget_s <= 0:
        p.error("--budget-s must be positive")
    if args.window is not None and not 30 <= args.window <= MAX_WINDOW_S:
        p.error(f"--window must be between 30 and {MAX_WINDOW_S:.0f} seconds (one device call)")
    if (args.rest_of or args.plan) and args.window is None:
        p.error("--rest-of and --plan go with --window")
    if args.rest_of and not any((args.rest_of / f"{s}.json").is_file() for s in STAGES):
        p.error(f"--rest-of: no stage JSON in {args.rest_of}")
    return args


def run_stage(stage: str, args: argparse.Namespace, info: dict) -> dict:
    device = "cuda" if info.get("cuda_available") and not args.dry_run else "cpu"
    ctx = StageContext(stage=stage, out=args.out, dry_run=args.dry_run, device=device, budget_s=args.budget_s)
    log(f"[{stage}] on {info.get('name')} ({device}), budget {args.budget_s:.0f} s")
    if args.install:
        build_test.install(ctx)
    MODULES[stage].run(ctx)
    report = ctx.report(info)
    (args.out / f"{stage}.json").write_text(json.dumps(report, indent=1, allow_nan=False) + "\n")
    with (args.out / "summary.md").open("a") as summary:
        summary.write(stage_markdown(report) + "\n")
    log(f"[{stage}] {'ok' if report['ok'] else 'FAILED: ' + ', '.join(report['failed'])} in {report['seconds']:.0f} s")
    return report


def all_steps() -> list[Step]:
    return [step for stage in STAGES for step in MODULES[stage].steps()]


def earlier(rest_of: Path | None, stage: str) -> dict | None:
    path = rest_of / f"{stage}.json" if rest_of else None
    return json.loads(path.read_text()) if path and path.is_file() else None


def step_status(statuses: list[str]) -> str:
    """A step's status from its items': failed if one failed, ok if one ran, else skipped."""
    return "failed" if "failed" in statuses else "ok" if "ok" in statuses else "skipped"


def write_window(args: argparse.Namespace, info: dict, contexts: dict[str, StageContext], plan: list[dict],
                 done: dict[str, str]) -> bool:
    """Every stage's JSON (with each step's status, which --rest-of reads), window.json (the plan with
    each step's status) and summary.md, rewritten whole."""
    reports = {stage: ctx.report(info) for stage, ctx in contexts.items()}
    stage_of = {step.name: step.stage for step in all_steps()}
    for stage, report in reports.items():
        report["window_s"] = args.window
        report["steps"] = {name: status for name, status in done.items() if stage_of.get(name) == stage}
        (args.out / f"{stage}.json").write_text(json.dumps(report, indent=1, allow_nan=False) + "\n")
    rows = [{**row, "status": done.get(row["name"], "not reached")} for row in plan]
    (args.out / "window.json").write_text(json.dumps({"window_s": args.window, "device": info.get("name"),
                                                      "steps": rows}, indent=1) + "\n")
    lines = [f"## GPU check in one {args.window:.0f} s window", "", "| tier | step | est s | status |",
             "|---|---|---|---|"]
    lines += [f"| {r['tier']} {r['tier_name']} | {r['stage']}/{r['name']} | {r['est_s']:.0f} | {r['status']} |"
              for r in rows]
    (args.out / "summary.md").write_text("\n".join(lines) + "\n\n" + "\n".join(
        stage_markdown(r) for r in reports.values()))
    return all(r["ok"] for r in reports.values())


def run_window(args: argparse.Namespace, info: dict) -> int:
    """One plan over every stage, by tier, against one clock; results written after every step."""
    device = "cuda" if info.get("cuda_available") and not args.dry_run else "cpu"
    contexts = {stage: StageContext(stage=stage, out=args.out, dry_run=args.dry_run, device=device,
                                    budget_s=args.window, cap_factor=WINDOW_CAP_FACTOR) for stage in STAGES}
    for ctx in contexts.values():
        ctx.started = contexts["build-test"].started  # one clock for the window
    done: dict[str, str] = {}  # step -> ok | failed | skipped, of this call and a first one
    for stage, ctx in contexts.items():
        report = earlier(args.rest_of, stage)
        if report:  # a first call's results stand; its skipped steps run again
            ctx.figures.update(report["figures"])
            ran = {step: status for step, status in report.get("steps", {}).items() if status != "skipped"}
            done.update(ran)
            ctx.items.extend(Item(**item) for item in report["items"] if item["status"] != "skipped")
            ctx.targets.extend(Target(**{k: v for k, v in t.items() if k != "met"}) for t in report["targets"])
    steps = [s for s in all_steps() if s.name not in done]
    plan = plan_table(steps, args.window)
    if args.plan:
        print(json.dumps({"window_s": args.window, "steps": plan}, indent=1))
        return 0
    log(f"window of {args.window:.0f} s on {info.get('name')} ({device}): {len(steps)} steps, "
        + ", ".join(f"tier {t} {n}" for t, n in TIERS.items()))
    if args.install:
        build_test.install(contexts["build-test"])
    ok = write_window(args, info, contexts, plan, done)
    for step in ordered(steps):
        ctx = contexts[step.stage]
        log(f"[window {ctx.left_s():.0f} s left] tier {step.tier}: {step.stage}/{step.name}")
        first = len(ctx.items)
        try:
            step.run(ctx)
        except Exception as exc:  # noqa: BLE001 - one broken step must not lose the window's report
            ctx.items.append(Item(step.name, "failed", reason=f"{type(exc).__name__} in the harness: {exc}"))
        done[step.name] = step_status([i.status for i in ctx.items[first:]])
        ok = write_window(args, info, contexts, plan, done)
    log(f"window: {'ok' if ok else 'FAILED'}; reports in {args.out}")
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    info = device_info(args.dry_run)
    if not args.dry_run and not info.get("cuda_available") and not args.plan:
        log(f"no CUDA device here ({info.get('probe_error') or info.get('name')}): use --dry-run on a CPU host")
        return 2
    if args.window is not None:
        return run_window(args, info)
    stages = STAGES if args.stage == "all" else (args.stage,)
    reports = [run_stage(stage, args, info) for stage in stages]
    return 0 if all(r["ok"] for r in reports) else 1


if __name__ == "__main__":
    sys.exit(main())
