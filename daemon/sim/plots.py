"""PNG plots of simulation results (matplotlib, imported lazily with the Agg backend):
latency CDFs of several runs, and a metric against offered load.
"""
from __future__ import annotations

from pathlib import Path

from loraplex.daemon.sim.simulator import SimResult


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_cdfs(results: dict[str, SimResult], path: Path, metric: str = "ttft") -> Path:
    """CDF of each run's per-request `metric` (ttft | tpt | e2e), in ms."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for label, result in results.items():
        values = sorted(v * 1e3 for r in result.records if (v := getattr(r, f"{metric}_s")) is not None)
        if values:
            ax.step(values, [(i + 1) / len(values) for i in range(len(values))], where="post", label=label)
    ax.set_xlabel(f"{metric.upper()} (ms)")
    ax.set_ylabel("fraction of requests")
    ax.set_xscale("symlog")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_vs_load(rows: list[dict[str, object]], path: Path, metric: str = "p99_ttft_ms") -> Path:
    """`metric` against `rate_rps`, one line per `label`."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    labels = list(dict.fromkeys(str(r["label"]) for r in rows))
    for label in labels:
        pts = sorted((float(r["rate_rps"]), float(r[metric]))  # type: ignore[arg-type]
                     for r in rows if r["label"] == label)
        ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=label)
    ax.set_xlabel("offered load (req/s)")
    ax.set_ylabel(metric)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
