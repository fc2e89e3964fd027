"""Plots of bench/peers.py reports (matplotlib, PNG): for each system, output tokens/s and the
slowdown over its own base-model run against the number of distinct adapters (log scale), one
line per popularity and ranks; the base-model throughput as a dashed line.

    .venv/bin/python bench/peers_plot.py bench/results/peers_sweep.json --out bench/results/peers_sweep.png
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402  (after the backend is chosen)

STYLES = {"loraplex": "tab:blue", "vllm": "tab:red", "peft": "tab:green"}
DASHES = {("zipf", "mixed"): "-", ("uniform", "mixed"): "--", ("zipf", "16"): "-.", ("uniform", "16"): ":"}


def load(paths: list[Path]) -> list[dict]:
    """Every ok result of the reports; the later report wins where two measured the same point."""
    seen: dict[tuple, dict] = {}
    for path in paths:
        for r in json.loads(path.read_text())["results"]:
            if r["ok"]:
                seen[(r["system"], r["point"])] = r
    return list(seen.values())


def curves(results: list[dict]) -> dict[tuple[str, str, str], list[tuple[int, dict]]]:
    """(system, popularity, ranks) -> [(adapters, result)] sorted by adapters."""
    out: dict[tuple[str, str, str], list[tuple[int, dict]]] = {}
    for r in results:
        if not r["base_only"]:
            out.setdefault((r["system"], r["popularity"], r["ranks"]), []).append((r["adapters"], r))
    return {k: sorted(v, key=lambda x: x[0]) for k, v in sorted(out.items())}


def plot(results: list[dict], out: Path, title: str) -> None:
    fig, (tput, slow) = plt.subplots(1, 2, figsize=(12, 4.5))
    for (system, popularity, ranks), points in curves(results).items():
        xs = [n for n, _ in points]
        label = f"{system} {popularity} r{ranks}"
        style = dict(color=STYLES.get(system, "black"), linestyle=DASHES.get((popularity, ranks), "-"), marker="o")
        tput.plot(xs, [r["output_tokens_per_s"] for _, r in points], label=label, **style)
        with_slowdown = [(n, r["slowdown_vs_base"]) for n, r in points if "slowdown_vs_base" in r]
        if with_slowdown:
            slow.plot(*zip(*with_slowdown), label=label, **style)
    for r in results:
        if r["base_only"]:
            tput.axhline(r["output_tokens_per_s"], color=STYLES.get(r["system"], "black"), linewidth=0.8,
                         linestyle=(0, (4, 4)), label=f"{r['system']} base model")
    for ax, ylabel in ((tput, "output tokens/s"), (slow, "slowdown over its base model (x)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("distinct adapters")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
    slow.axhline(1.0, color="grey", linewidth=0.8)
    tput.legend(fontsize=7)
    slow.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("reports", type=Path, nargs="+", help="bench/peers.py --json outputs")
    p.add_argument("--out", type=Path, required=True, help="the PNG to write")
    p.add_argument("--title", default="bench/peers.py: throughput and slowdown against distinct adapters")
    args = p.parse_args(argv)
    results = load(args.reports)
    if not any(not r["base_only"] for r in results):
        print("peers_plot: no adapter results in the reports", file=sys.stderr)
        return 1
    plot(results, args.out, args.title)
    print(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
