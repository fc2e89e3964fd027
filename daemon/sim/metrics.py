"""Summaries of a simulation (torch-free): latency percentiles, throughput, goodput, SLO
attainment, cache hit rate and PCIe bytes as one flat row of numbers, plus ratio tables.
"""
from __future__ import annotations

import math

from loraplex.daemon.sim.simulator import SimResult

QUANTILES = (("p50", 0.5), ("p90", 0.9), ("p99", 0.99))


def pct(values: list[float], q: float) -> float:
    """Nearest-rank percentile of sorted values (0 when empty)."""
    return values[min(len(values) - 1, max(0, math.ceil(q * len(values)) - 1))] if values else 0.0


def _stats(name: str, values_s: list[float]) -> dict[str, float]:
    ms = sorted(v * 1e3 for v in values_s)
    out = {f"mean_{name}_ms": sum(ms) / len(ms) if ms else 0.0}
    out.update({f"{q}_{name}_ms": pct(ms, x) for q, x in QUANTILES})
    return out


def summarize(result: SimResult) -> dict[str, object]:
    cfg = result.config
    done = [r for r in result.records if r.finish_s is not None and not r.aborted]
    met = [r for r in done
           if (r.ttft_s or 0.0) * 1e3 <= cfg.ttft_slo_ms and (r.tpt_s or 0.0) * 1e3 <= cfg.tpt_slo_ms]
    span = result.makespan_s
    n = len(result.records)
    accesses = result.cache_hits + result.cache_misses
    row: dict[str, object] = {
        "label": cfg.policy, "policy": cfg.policy, "scheduler": cfg.policy, "cache_policy": cfg.cache_policy,
        "mode": cfg.mode, "router": cfg.router, "kernel": result.profile.kernel,
        "engines": cfg.num_engines, "ttft_slo_ms": cfg.ttft_slo_ms, "tpt_slo_ms": cfg.tpt_slo_ms,
        "requests": n, "completed": len(done),
        "aborted": sum(r.aborted for r in result.records),
        "slo_attainment": len(met) / n if n else 0.0,
        "throughput_rps": len(done) / span if span else 0.0,
        "goodput_rps": len(met) / span if span else 0.0,
        "tokens_per_s": sum(r.output_tokens for r in done) / span if span else 0.0,
    }
    row.update(_stats("ttft", [r.ttft_s for r in done if r.ttft_s is not None]))
    row.update(_stats("tpt", [r.tpt_s for r in done if r.tpt_s is not None]))
    row.update(_stats("e2e", [r.e2e_s for r in done if r.e2e_s is not None]))
    row.update({"cache_hit_rate": result.cache_hits / accesses if accesses else 1.0,
                "pcie_bytes": result.pcie_bytes, "steps": result.steps, "makespan_s": span})
    return row


RATIO_KEYS = ("mean_ttft_ms", "p99_ttft_ms", "mean_tpt_ms", "p99_tpt_ms", "mean_e2e_ms", "throughput_rps",
              "goodput_rps", "slo_attainment", "cache_hit_rate")


def ratios(rows: list[dict[str, object]], baseline: int = 0) -> list[dict[str, object]]:
    """Each row's metrics divided by the baseline row's (None where the baseline is 0)."""
    base = rows[baseline]
    out = []
    for row in rows:
        r: dict[str, object] = {"label": row.get("label", row["policy"])}
        for key in RATIO_KEYS:
            b = float(base[key])  # type: ignore[arg-type]
            r[key] = float(row[key]) / b if b else None  # type: ignore[arg-type]
        out.append(r)
    return out


def format_table(rows: list[dict[str, object]], keys: tuple[str, ...]) -> str:
    """A plain fixed-width text table of `keys` (numbers with 3 significant decimals)."""
    def cell(v: object) -> str:
        if isinstance(v, float):
            return f"{v:.3f}"
        return "-" if v is None else str(v)

    table = [list(keys)] + [[cell(r.get(k)) for k in keys] for r in rows]
    widths = [max(len(line[i]) for line in table) for i in range(len(keys))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(line, widths)) for line in table)
