"""Every Triton kernel compiled for sm_90 and sm_80 at every launch configuration the engine
can choose (kernels/launch_space.py), by each Triton toolchain at hand: this venv's and the GPU
host's `.venv-host` (`make venv-host`). Per configuration: registers per thread, spill stores
and loads, shared memory, estimated occupancy, global load widths in the PTX. No GPU needed.

Prints a summary table, or with `--json` one JSON object on stdout; progress goes to stderr.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
# one row per (toolchain, target, launch); shared in bytes, occupancy in resident warps / 64,
# global_load_bytes: PTX global loads by bytes per instruction
COLUMNS = ("triton", "target", "name", "num_warps", "registers", "spill_stores", "spill_loads", "stack_frame",
           "shared", "occupancy", "global_load_bytes", "seconds", "ok", "error")
DECODE_KERNELS = ("_gemv_shrink_kernel", "_gemv_expand_kernel", "_decode_split_kernel", "_decode_reduce_kernel")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtypes", nargs="+", choices=("fp16", "bf16", "fp32"), default=["fp16", "bf16", "fp32"])
    p.add_argument("--targets", nargs="+", type=int, choices=(90, 80), default=[90, 80])
    p.add_argument("--python", nargs="+", default=None,
                   help="interpreters to compile with (default: this one and .venv-host's when built)")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="compile workers at a time")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument("--out", type=Path, default=None, help="also write the JSON object to this file")
    return p.parse_args(argv)


def dump(report: dict[str, Any]) -> str:
    """The report as indented JSON with one line per result row (a file a reader can scan)."""
    head = json.dumps({k: v for k, v in report.items() if k != "results"}, indent=1, allow_nan=False)
    rows = ",\n  ".join(json.dumps(row, separators=(",", ":"), allow_nan=False)
                        for row in report["results"]["rows"])
    return (f'{head[:-2]},\n "results": {{\n  "columns": {json.dumps(report["results"]["columns"])},\n'
            f'  "rows": [\n  {rows}\n  ]\n }}\n}}\n')


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def summarise(records: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, dict[str, Any]]]]:
    """triton version -> target -> kernel -> configurations, worst registers/spills/shared, least occupancy."""
    out: dict[str, dict[str, dict[str, dict[str, Any]]]] = defaultdict(lambda: defaultdict(dict))
    groups: dict[tuple[str, str, str], list[dict[str, Any]]] = defaultdict(list)
    for r in records:
        groups[(r["triton"], r["target"], r["kernel"])].append(r)
    for (version, target, kernel), rows in sorted(groups.items()):
        ok = [r for r in rows if r["ok"]]
        worst = max(ok, key=lambda r: (r["spill_stores"], r["registers"]), default=None)
        out[version][target][kernel] = {
            "configs": len(rows), "failures": len(rows) - len(ok),
            "max_registers": max((r["registers"] for r in ok), default=None),
            "configs_over_128_registers": sum(r["registers"] > 128 for r in ok),
            "configs_spilling": sum(r["spill_stores"] + r["spill_loads"] > 0 for r in ok),
            "max_spill_stores": max((r["spill_stores"] for r in ok), default=None),
            "max_shared": max((r["shared"] for r in ok), default=None),
            "min_occupancy": min((r["occupancy"] for r in ok), default=None),
            "worst": worst["name"] if worst else None,
        }
    return {v: {t: dict(k) for t, k in ts.items()} for v, ts in out.items()}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    from loraplex.kernels import launch_space
    from loraplex.kernels.compile_check import DTYPE_NAMES, host_python, run

    pythons = args.python or [sys.executable] + ([str(host_python(ROOT))] if host_python(ROOT) else [])
    launches = launch_space.distinct_launches([getattr(torch, DTYPE_NAMES[d]) for d in args.dtypes])
    log(f"{len(launches)} distinct launches x {len(args.targets)} targets x {len(pythons)} toolchains, "
        f"{args.jobs} workers")
    load_before = os.getloadavg()[0]
    start = time.perf_counter()
    records = run(pythons, dtypes=args.dtypes, targets=args.targets, jobs=args.jobs, cwd=ROOT, timeout=7200,
                  progress=True)
    seconds = time.perf_counter() - start
    failures = [{k: r[k] for k in ("triton", "target", "name", "error")} for r in records if not r["ok"]]
    over_shared = [{k: r[k] for k in ("triton", "target", "name", "shared", "shared_limit")}
                   for r in records if r["ok"] and not r["shared_ok"]]
    decode_spills = [{k: r[k] for k in ("triton", "target", "name", "registers", "spill_stores", "spill_loads")}
                     for r in records if r["ok"] and r["kernel"] in DECODE_KERNELS
                     and r["spill_stores"] + r["spill_loads"]]
    toolchains = sorted({(r["python"], r["triton"]) for r in records})
    report: dict[str, Any] = {
        "benchmark": "kernel_compile",
        "env": {"python": platform.python_version(), "cpu_count": os.cpu_count(),
                "loadavg_1m": [load_before, os.getloadavg()[0]], "date": time.strftime("%Y-%m-%d %H:%M UTC",
                                                                                      time.gmtime())},
        "config": {"dtypes": args.dtypes, "targets": [f"sm_{t}" for t in args.targets], "jobs": args.jobs,
                   "toolchains": [{"python": str(Path(py).relative_to(ROOT)) if Path(py).is_relative_to(ROOT)
                                   else py, "triton": v} for py, v in toolchains]},
        "domain": {"dtypes": [str(d).removeprefix("torch.") for d in launch_space.DTYPES],
                   "head_dims": launch_space.HEAD_DIMS, "gqa_groups": launch_space.GQA_GROUPS,
                   "lora_ranks": launch_space.LORA_RANKS, "in_features": launch_space.IN_FEATURES,
                   "out_features": launch_space.OUT_FEATURES, "decode_tokens": launch_space.DECODE_TOKENS,
                   "decode_split_tokens": launch_space.DECODE_SPLIT_TOKENS,
                   "page_tokens": launch_space.PAGE_TOKENS, "precisions": launch_space.PRECISIONS},
        "engine_launches": sum(1 for _ in launch_space.engine_launches(
            [getattr(torch, DTYPE_NAMES[d]) for d in args.dtypes])),
        "distinct_launches": len(launches),
        "compiles": len(records),
        "seconds": round(seconds, 1),
        "compile_seconds_sum": round(sum(r.get("seconds", 0.0) for r in records), 1),
        "failures": failures,
        "over_shared_limit": over_shared,
        "decode_spills": decode_spills,
        "summary": summarise(records),
        "results": {"columns": list(COLUMNS), "rows": [[r.get(c) for c in COLUMNS] for r in records]},
    }
    text = json.dumps(report, allow_nan=False)
    if args.out:
        args.out.write_text(dump(report))
    if args.json:
        print(text)
    else:
        print_table(report)
    return 1 if failures or over_shared else 0


def print_table(report: dict[str, Any]) -> None:
    print(f"{report['distinct_launches']} launches, {report['compiles']} compiles in {report['seconds']} s; "
          f"{len(report['failures'])} failed, {len(report['over_shared_limit'])} over the shared limit, "
          f"{len(report['decode_spills'])} decode spills")
    print(f"{'triton':>7} {'target':>6} {'kernel':<22} {'cfgs':>4} {'max reg':>7} {'>128':>4} {'spill':>5} "
          f"{'max spill B':>11} {'max smem B':>10} {'min occ':>7}")
    for version, targets in report["summary"].items():
        for target, kernels in targets.items():
            for kernel, s in kernels.items():
                print(f"{version:>7} {target:>6} {kernel:<22} {s['configs']:>4} {s['max_registers']!s:>7} "
                      f"{s['configs_over_128_registers']:>4} {s['configs_spilling']:>5} "
                      f"{s['max_spill_stores']!s:>11} {s['max_shared']!s:>10} {s['min_occupancy']!s:>7}")


if __name__ == "__main__":
    sys.exit(main())
