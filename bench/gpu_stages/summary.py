"""Markdown of one stage's report: its items (status, time, reason) and its
targets (value, bound, met). Used for `<out>/summary.md` and, through
bench/gpu_report.py, for the GPU section of bench/RESULTS.md.
"""
from __future__ import annotations

from typing import Any

MARK = {True: "met", False: "**not met**", None: "n/a"}


def fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:,.0f}"
    return str(value)


def stage_markdown(report: dict[str, Any]) -> str:
    verdict = "ok" if report["ok"] else f"**failed**: {', '.join(report['failed'])}"
    dry = " (dry run: toy sizes on the CPU, timings meaningless)" if report.get("dry_run") else ""
    lines = [f"### Stage `{report['stage']}`{dry}", "",
             f"{report['device']}; {report['seconds']:.0f} s of a {report['budget_s']:.0f} s budget; {verdict}", "",
             "| item | status | s | note |", "|---|---|---|---|"]
    for item in report["items"]:
        note = (item.get("reason") or "").replace("\n", " ").replace("|", "/")[:160]
        failures = item.get("figures", {}).get("failures")
        if failures:  # a pytest item: which tests, so the section says what to fix
            note = (note + " failed: " + ", ".join(f"`{f.split('::')[-1]}`" for f in failures)).strip()
        status = item["status"] if item["status"] != "failed" else "**failed**"
        lines.append(f"| {item['name']} | {status} | {item['seconds']:.1f} | {note} |")
    if report["targets"]:
        lines += ["", "| figure | value | target | | source |", "|---|---|---|---|---|"]
        for t in report["targets"]:
            lines.append(f"| {t['name']} | {fmt(t['value'])} | {t['sense']} {fmt(t['bound'])} | {MARK[t['met']]} "
                         f"| {t['source']} |")
    return "\n".join(lines) + "\n"
