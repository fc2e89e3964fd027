"""Named simulation scenarios (torch-free): one workload, one latency profile and the
variants compared on it (cache policies, schedulers or loading modes), each a few seconds.

Adapter popularity is Zipf with the exponent stated in each workload (the Azure Functions
trace is not available offline; see shared/traces/README.md).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from loraplex.daemon.sim.metrics import summarize
from loraplex.daemon.sim.profile import SimProfile
from loraplex.daemon.sim.simulator import SimConfig, SimResult, simulate
from loraplex.daemon.sim.workload import WorkloadSpec, generate


@dataclass(frozen=True, slots=True)
class Scenario:
    name: str
    description: str
    workload: WorkloadSpec
    profile: SimProfile
    variants: tuple[tuple[str, SimConfig], ...]  # (label, config), the first is the baseline


def _cache() -> Scenario:
    base = SimConfig(policy="fcfs", mode="on_demand")
    return Scenario(
        "chameleon-cache", "GPU adapter cache none/lru/cost under Zipf(1.0) popularity over 200 adapters",
        WorkloadSpec(seed=0, duration_s=60, rate_rps=3.0, num_adapters=200, zipf_exponent=1.0,
                     prompt_mean=256, output_mean=64),
        SimProfile(pool_pages=1200, pcie_bytes_per_s=3.2e9),  # pageable host copies (Chameleon's baseline)
        tuple((p, dataclasses.replace(base, cache_policy=p)) for p in ("none", "lru", "cost")))


def _mlq() -> Scenario:
    base = SimConfig(mode="cached", ttft_slo_ms=1500.0)
    return Scenario(
        "chameleon-mlq", "FCFS vs Chameleon MLQ under heavy-tailed (log-normal sigma 1.5) lengths",
        WorkloadSpec(seed=0, duration_s=60, rate_rps=5.0, num_adapters=50, zipf_exponent=1.0,
                     prompt_mean=256, prompt_sigma=1.5, output_mean=48, output_sigma=1.5, max_output=1024),
        SimProfile(max_num_seqs=24),
        tuple((p, dataclasses.replace(base, policy=p)) for p in ("fcfs", "mlq")))


def _modes() -> Scenario:
    base = SimConfig(policy="fcfs", cache_policy="lru")
    return Scenario(
        "toppings-modes", "all-cached vs on-demand loading vs CPU-assisted prefill of cold adapters",
        WorkloadSpec(seed=0, duration_s=60, rate_rps=2.0, num_adapters=500, zipf_exponent=0.8,
                     prompt_mean=256, output_mean=64),
        SimProfile(pool_pages=1500, pcie_bytes_per_s=3.2e9),
        tuple((m, dataclasses.replace(base, mode=m)) for m in ("cached", "on_demand", "cpu_assist")))


def _dlora() -> Scenario:
    base = SimConfig(mode="cached")
    return Scenario(
        "dlora", "FCFS (always unmerged) vs dLoRA merged/unmerged batching on a skewed Zipf(2.0) mix of 8 adapters",
        WorkloadSpec(seed=0, duration_s=40, rate_rps=4.5, num_adapters=8, zipf_exponent=2.0,
                     ranks=(64, 128), prompt_mean=128, output_mean=96),
        SimProfile(alpha_ms=0.03),
        tuple((p, dataclasses.replace(base, policy=p)) for p in ("fcfs", "dlora")))


SCENARIOS = {s.name: s for s in (_cache(), _mlq(), _modes(), _dlora())}


def get(name: str) -> Scenario:
    if name not in SCENARIOS:
        raise ValueError(f"unknown scenario {name!r}; choose one of {', '.join(SCENARIOS)}")
    return SCENARIOS[name]


def run_variants(scenario: Scenario, workload: WorkloadSpec | None = None
                 ) -> tuple[list[dict[str, object]], dict[str, SimResult]]:
    """Every variant on the same trace: one summary row each (labelled), and the raw results."""
    spec = workload or scenario.workload
    events = generate(spec)
    rows, results = [], {}
    for label, config in scenario.variants:
        result = simulate(events, config, scenario.profile)
        results[label] = result
        rows.append({**summarize(result), "label": label, "policy": label, "scenario": scenario.name,
                     "rate_rps": spec.rate_rps, "zipf_exponent": spec.zipf_exponent})
    return rows, results


def sweep(scenario: Scenario, rates: list[float]) -> list[dict[str, object]]:
    """run_variants at each arrival rate (the same seed, so traces differ only in rate)."""
    rows: list[dict[str, object]] = []
    for rate in sorted(rates):
        rows += run_variants(scenario, dataclasses.replace(scenario.workload, rate_rps=rate))[0]
    return rows
