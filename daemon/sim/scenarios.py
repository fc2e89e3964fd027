"""Named simulation scenarios (torch-free): one workload, one latency profile and the
variants compared on it (cache policies, schedulers, routers or loading modes), optionally
swept over arrival rates. Most run in seconds; toppings-cluster (60 engines) in about a
minute per core. Each has a --quick preset (a smaller workload) that runs in seconds.

Adapter popularity is Zipf with the exponent stated in each workload (the Azure Functions
trace is not available offline; see shared/traces/README.md). Profiles are illustrative
(SimProfile), not measurements; each scenario states what it changes and why.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from loraplex.daemon.sim.profile import SimProfile
from loraplex.daemon.sim.progress import Progress
from loraplex.daemon.sim.runner import SimRun, run_all
from loraplex.daemon.sim.simulator import SimConfig, SimResult
from loraplex.daemon.sim.workload import RequestEvent, WorkloadSpec, generate


@dataclass(frozen=True, slots=True)
class Quick:
    """A scenario's --quick preset: the same comparison at a smaller scale, in under 20 s on
    one core. workload: WorkloadSpec fields replaced; rates: the sweep (None: the scenario's
    own); engines: every variant's engine count (None: unchanged)."""

    workload: tuple[tuple[str, object], ...] = ()
    rates: tuple[float, ...] | None = None
    engines: int | None = None


@dataclass(frozen=True, slots=True)
class Scenario:
    name: str
    description: str
    workload: WorkloadSpec
    profile: SimProfile
    variants: tuple[tuple[str, SimConfig], ...]  # (label, config), the first is the baseline
    rates: tuple[float, ...] = ()  # the load sweep `loraplex sim --scenario` runs (empty: one rate)
    # TPT SLO = this × the mean TPT of the same trace served without LoRA by the baseline
    # variant (Toppings' "1.5× the no-LoRA TPT"); None: each variant's own tpt_slo_ms.
    tpt_slo_x: float | None = None
    quick: Quick = Quick()

    def quick_preset(self) -> Scenario:
        """This scenario scaled down by its Quick preset (`loraplex sim --quick`)."""
        q = self.quick
        variants = self.variants if q.engines is None else tuple(
            (label, dataclasses.replace(config, num_engines=q.engines)) for label, config in self.variants)
        return dataclasses.replace(self, description=f"{self.description} (quick preset)",
                                   workload=dataclasses.replace(self.workload, **dict(q.workload)),
                                   variants=variants, rates=self.rates if q.rates is None else q.rates)


def _chameleon_cache() -> Scenario:
    # Chameleon's headline comparison: the S-LoRA-like baseline (FCFS, adapters freed on last use)
    # against its cost-aware cache plus multi-level queues; fcfs+cost separates the two parts.
    return Scenario(
        "chameleon-cache", "P99 TTFT vs load: fcfs+none vs mlq+cost (fcfs+cost between) on Azure conv lengths, "
        "Zipf(1.0) over 200 adapters",
        WorkloadSpec(seed=0, duration_s=60, rate_rps=2.0, num_adapters=200, zipf_exponent=1.0, lengths="trace",
                     trace="conv"),
        SimProfile(pool_pages=1200, pcie_bytes_per_s=3.2e9),  # pageable host copies (Chameleon's baseline)
        tuple((label, SimConfig(policy=policy, cache_policy=cache, mode="on_demand"))
              for label, policy, cache in (("fcfs+none", "fcfs", "none"), ("fcfs+cost", "fcfs", "cost"),
                                           ("mlq+cost", "mlq", "cost"))),
        rates=(1.0, 2.0, 2.5, 3.0, 3.5), quick=Quick(workload=(("duration_s", 20.0),), rates=(1.0, 2.5, 3.5)))


def _mlq() -> Scenario:
    base = SimConfig(mode="cached", ttft_slo_ms=1500.0)
    return Scenario(
        "chameleon-mlq", "FCFS vs Chameleon MLQ under heavy-tailed (log-normal sigma 1.5) lengths",
        WorkloadSpec(seed=0, duration_s=60, rate_rps=5.0, num_adapters=50, zipf_exponent=1.0,
                     prompt_mean=256, prompt_sigma=1.5, output_mean=48, output_sigma=1.5, max_output=1024),
        SimProfile(max_num_seqs=24),
        tuple((p, dataclasses.replace(base, policy=p)) for p in ("fcfs", "mlq")),
        quick=Quick(workload=(("duration_s", 20.0),)))


def _modes() -> Scenario:
    base = SimConfig(policy="fcfs", cache_policy="lru")
    return Scenario(
        "toppings-modes", "all-cached vs on-demand loading vs CPU-assisted prefill of cold adapters",
        WorkloadSpec(seed=0, duration_s=60, rate_rps=2.0, num_adapters=500, zipf_exponent=0.8,
                     prompt_mean=256, output_mean=64),
        SimProfile(pool_pages=1500, pcie_bytes_per_s=3.2e9),
        tuple((m, dataclasses.replace(base, mode=m)) for m in ("cached", "on_demand", "cpu_assist")),
        quick=Quick(workload=(("duration_s", 20.0),)))


def _dlora() -> Scenario:
    base = SimConfig(mode="cached")
    return Scenario(
        "dlora", "FCFS (always unmerged) vs dLoRA merged/unmerged batching on a skewed Zipf(2.0) mix of 8 adapters",
        WorkloadSpec(seed=0, duration_s=40, rate_rps=4.5, num_adapters=8, zipf_exponent=2.0,
                     ranks=(64, 128), prompt_mean=128, output_mean=96),
        SimProfile(alpha_ms=0.03),
        tuple((p, dataclasses.replace(base, policy=p)) for p in ("fcfs", "dlora")),
        quick=Quick(workload=(("duration_s", 15.0),)))


def _toppings_cluster() -> Scenario:
    # Toppings Fig. 18-19 at its scale: 60 instances, 40,000 adapters, ~340 req/s. Adapters are
    # all cached (loads cost nothing) so only placement differs. The engine's decode step is
    # exactly the router's PERF model (decode_ms_per_row = 0: the per-row base cost is folded
    # into alpha, as in Toppings), with 7B-like magnitudes: a 20 ms base step, padded BGMV adding
    # 0.005 ms per request·max-rank unit (24 rows at rank 64: +7.7 ms), 0.1 ms per prefill token.
    base = SimConfig(policy="fcfs", mode="cached", num_engines=60, ttft_slo_ms=60_000.0)  # attainment: TPT only
    return Scenario(
        "toppings-cluster", "rank_aware vs random / first_fit / most_idle / dlora routing over 60 engines, "
        "Zipf(1.0) over 40,000 adapters at 340 req/s, TPT SLO 1.5x the no-LoRA TPT",
        WorkloadSpec(seed=0, duration_s=15, rate_rps=340.0, num_adapters=40_000, zipf_exponent=1.0,
                     prompt_mean=256, output_mean=128),
        SimProfile(kernel="bgmv", alpha_ms=0.005, beta_ms=20.0, prefill_ms_per_token=0.1, decode_ms_per_row=0.0),
        tuple((r, dataclasses.replace(base, router=r))
              for r in ("random", "first_fit", "most_idle", "dlora", "rank_aware")),
        # quick: a tenth of the cluster at a tenth of the load and adapters (the same load per
        # engine), over 8 s of arrivals.
        tpt_slo_x=1.5, quick=Quick(workload=(("rate_rps", 34.0), ("num_adapters", 4_000), ("duration_s", 8.0)),
                                   engines=6))


def _slora_abort() -> Scenario:
    # S-LoRA §4.3: under overload, early abort keeps serving requests that can still make the
    # TTFT SLO, FCFS serves everyone late and LCFS starves the oldest. Attainment counts the
    # TTFT SLO only (the TPT SLO is out of reach), as S-LoRA's first-token SLO does.
    base = SimConfig(mode="cached", ttft_slo_ms=2000.0, tpt_slo_ms=60_000.0)
    return Scenario(
        "slora-abort", "FCFS vs LCFS vs FCFS with early abort (TTFT SLO 2 s) from light load to 2x overload",
        WorkloadSpec(seed=0, duration_s=60, rate_rps=8.0, num_adapters=100, zipf_exponent=1.0, prompt_mean=256,
                     output_mean=128),
        SimProfile(),
        (("fcfs", base), ("lcfs", dataclasses.replace(base, policy="lcfs")),
         ("abort", dataclasses.replace(base, early_abort=True))),
        rates=(4.0, 6.0, 8.0, 10.0, 12.0), quick=Quick(workload=(("duration_s", 20.0),), rates=(4.0, 8.0, 12.0)))


SCENARIOS = {s.name: s for s in (_chameleon_cache(), _mlq(), _modes(), _dlora(), _toppings_cluster(),
                                 _slora_abort())}


def get(name: str) -> Scenario:
    if name not in SCENARIOS:
        raise ValueError(f"unknown scenario {name!r}; choose one of {', '.join(SCENARIOS)}")
    return SCENARIOS[name]


def without_lora(events: list[RequestEvent]) -> list[RequestEvent]:
    """The same requests sent to the base model."""
    return [dataclasses.replace(e, adapter=None, rank=0) for e in events]


def runs_per_rate(scenario: Scenario) -> int:
    """Simulations one rate of `scenario` takes: its variants, and the no-LoRA baseline its
    TPT SLO is taken from."""
    return len(scenario.variants) + (scenario.tpt_slo_x is not None)


def run_variants(scenario: Scenario, workload: WorkloadSpec | None = None, *, workers: int = 1,
                 progress: Progress | None = None, keep_results: bool = True
                 ) -> tuple[list[dict[str, object]], dict[str, SimResult]]:
    """Every variant on the same trace: one summary row each (labelled), and the raw results by
    label (empty unless keep_results, which runs them in this process)."""
    return _run_specs(scenario, [workload or scenario.workload], workers, progress, 0 if keep_results else None)


def sweep(scenario: Scenario, rates: list[float] | tuple[float, ...], *, workers: int = 1,
          progress: Progress | None = None, keep_highest: bool = False
          ) -> tuple[list[dict[str, object]], dict[str, SimResult]]:
    """run_variants at each arrival rate (the same seed, so traces differ only in rate); the raw
    results of the highest rate are kept when asked (for plots)."""
    specs = [dataclasses.replace(scenario.workload, rate_rps=rate) for rate in sorted(rates)]
    return _run_specs(scenario, specs, workers, progress, len(specs) - 1 if keep_highest else None)


def _run_specs(scenario: Scenario, specs: list[WorkloadSpec], workers: int, progress: Progress | None,
               keep: int | None) -> tuple[list[dict[str, object]], dict[str, SimResult]]:
    """Rows for every (workload, variant), workload-major; the raw results of specs[keep]. With
    a TPT SLO taken from the no-LoRA baseline the baselines run first (rank_aware routes by it)."""
    traces = [generate(spec) for spec in specs]
    slo: list[float | None] = [None] * len(specs)
    done = 0
    if scenario.tpt_slo_x is not None:
        base_config = scenario.variants[0][1]
        baselines = run_all([SimRun(f"no-LoRA@{spec.rate_rps:g}", without_lora(events), base_config,
                                    scenario.profile) for spec, events in zip(specs, traces)],
                            workers=workers, progress=progress)
        slo = [float(o.summary["mean_tpt_ms"]) for o in baselines]  # type: ignore[arg-type]
        done = len(baselines)
    runs: list[SimRun] = []
    keys: list[tuple[int, str, float | None]] = []
    for i, (spec, events, no_lora) in enumerate(zip(specs, traces, slo)):
        for label, config in scenario.variants:
            if no_lora is not None:
                config = dataclasses.replace(config, tpt_slo_ms=scenario.tpt_slo_x * no_lora)
            runs.append(SimRun(label if len(specs) == 1 else f"{label}@{spec.rate_rps:g}", events, config,
                               scenario.profile))
            keys.append((i, label, no_lora))
    kept = [j for j, key in enumerate(keys) if key[0] == keep]
    rest = [j for j, key in enumerate(keys) if key[0] != keep]
    outcomes = dict(zip(rest, run_all([runs[j] for j in rest], workers=workers, progress=progress, first=done)))
    outcomes.update(zip(kept, run_all([runs[j] for j in kept], progress=progress, first=done + len(rest),
                                      keep_results=True)))
    rows, results = [], {}
    for j, (i, label, no_lora) in enumerate(keys):
        extra = {} if no_lora is None else {"no_lora_tpt_ms": no_lora}
        rows.append({**outcomes[j].summary, **extra, "label": label, "policy": label, "scenario": scenario.name,
                     "rate_rps": specs[i].rate_rps, "zipf_exponent": specs[i].zipf_exponent})
        if outcomes[j].result is not None:
            results[label] = outcomes[j].result  # type: ignore[assignment]
    return rows, results
