"""Render a GPU validation run (the `<stage>.json` files bench/gpu_check.py wrote)
into the GPU section of bench/RESULTS.md: device, date, commit, each stage's
items, its figures and its targets (met or not).

    python bench/gpu_report.py bench/results/gpu            # rewrite the section in bench/RESULTS.md
    python bench/gpu_report.py DIR --print                  # print it instead

The section lives between two marker lines, so a rerun replaces it and leaves
the rest of the file alone.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from gpu_stages import STAGES
from gpu_stages.summary import stage_markdown

BEGIN = "<!-- gpu-check:begin (bench/gpu_report.py writes this section) -->"
END = "<!-- gpu-check:end -->"
RESULTS = Path(__file__).resolve().parent / "RESULTS.md"


def compact(value: Any) -> Any:
    """Figures rounded for reading: 3 significant digits."""
    if isinstance(value, float):
        return float(f"{value:.3g}")
    if isinstance(value, dict):
        return {k: compact(v) for k, v in value.items()}
    if isinstance(value, list):
        return [compact(v) for v in value]
    return value


def load_reports(run_dir: Path) -> list[dict[str, Any]]:
    reports = [json.loads((run_dir / f"{s}.json").read_text()) for s in STAGES if (run_dir / f"{s}.json").exists()]
    if not reports:
        raise FileNotFoundError(f"no stage JSON (build-test.json, ...) in {run_dir}")
    return reports


def render(reports: list[dict[str, Any]], run_dir: Path) -> str:
    first = reports[0]
    info = first.get("device_info", {})
    lines = [BEGIN, "## GPU validation (bench/gpu_check.py)", "",
             f"Device: {first['device']} (torch {info.get('torch')}, CUDA {info.get('cuda')}, triton "
             f"{info.get('triton')}, {info.get('cpu_count')} CPU cores); run {first.get('date')} at commit "
             f"{info.get('commit')}; JSON in `{run_dir}`. Commands: bench/README.md, \"GPU validation\".", ""]
    if any(r.get("dry_run") for r in reports):
        lines += ["**Dry run**: toy sizes on a CPU; these figures check the harness, not the GPU.", ""]
    for report in reports:
        lines.append(stage_markdown(report))
        if report["figures"]:
            lines += ["<details><summary>figures</summary>", "", "```json",
                      json.dumps(compact(report["figures"]), indent=1), "```", "</details>", ""]
    lines.append(END)
    return "\n".join(lines) + "\n"


def replace_section(text: str, section: str) -> str:
    if BEGIN in text and END in text:
        head, rest = text.split(BEGIN, 1)
        tail = rest.split(END, 1)[1].lstrip("\n")
        return head + section + ("\n" + tail if tail else "")
    return text.rstrip("\n") + "\n\n" + section


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run_dir", type=Path, help="folder holding the stage JSON files")
    p.add_argument("--results", type=Path, default=RESULTS, help="the Markdown file to update")
    p.add_argument("--print", action="store_true", help="print the section instead of writing it")
    args = p.parse_args(argv)
    try:
        section = render(load_reports(args.run_dir), args.run_dir)
    except (OSError, ValueError, KeyError) as exc:
        print(f"gpu_report: {exc}", file=sys.stderr)
        return 2
    if args.print:
        sys.stdout.write(section)
        return 0
    args.results.write_text(replace_section(args.results.read_text(), section))
    print(f"gpu_report: wrote the GPU section of {args.results}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
