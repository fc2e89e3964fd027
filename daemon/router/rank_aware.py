"""Rank-aware routing (Toppings/CaraServe §5, Algorithm 1), torch-free.

The decode step of a batch S of LoRA requests costs, by kernel:
  BGMV  (pads every row to the batch's largest rank): α·|S|·max rank + β
  MBGMV (each row at its own rank):                   α·Σ rank + β
For each healthy instance the router predicts that latency before and after
adding the new request to the instance's batch (running and queued) and picks
the instance with the lowest cost = the latency increase, plus `penalty_ms`
for every request of that batch whose SLO the new latency would break (all
of them share the step). So a high-rank request joins a batch that is padded
to that rank already under BGMV, while under MBGMV, where every instance pays
the same increase, the SLO decides. Ties go to the lower resulting latency.

α/β come from a profile file, JSON of the form
  {"bgmv": {"alpha": 0.0225, "beta": 4.0}, "mbgmv": {"alpha": 0.03, "beta": 4.0}}
with α in ms per rank unit and β in ms. The defaults are illustrative, not a
measurement, chosen so that in the Toppings Fig. 6 example (24 rank-32 requests
on instance 1, 16 rank-64 on instance 2, SLO 36 ms, a new rank-64 request) the
SLO is binding under both kernels — BGMV: 40.0 ms on instance 1 (breaks it)
vs 28.5 ms on instance 2; MBGMV: 29.0 ms vs 36.6 ms (breaks it).

Corrections for real engines, from the steps each engine reports (EngineState.step_ms,
step_ms_std, step_*_units, prefill_ms_per_token) and its requests' progress:
- the prediction adds the step time the model does not explain on that engine
  (observed minus predicted for the same steps: prefill chunks share decode steps
  under continuous batching);
- the SLO check judges each request by the mean of all its steps: those it ran
  (a request ahead of the SLO can take slower steps, one behind needs faster ones)
  and its n remaining ones, with headroom k·σ/√n for their scatter;
- the new request's own prefill lands on one step of every running request, so
  a long prompt is charged to the engines whose requests it would push over.
Only the misses a placement causes are charged.
Profile a real engine (bench) and pass its file for production use.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar, Literal
from typing import Sequence as Seq

from loraplex.daemon.json_file import read_json_file
from loraplex.daemon.router.base import Router, healthy
from loraplex.daemon.router.state import EngineState, RequestInfo, lora_units

Kernel = Literal["bgmv", "mbgmv"]
KERNELS: tuple[str, ...] = ("bgmv", "mbgmv")
# SLO margin in standard deviations of a request's mean step time (see violations()); 2: about
# 98% of requests whose steps average to the prediction stay within the SLO.
SPREAD_K = 2.0


@dataclass(frozen=True, slots=True)
class KernelCost:
    alpha: float  # ms per rank unit (BGMV: per request·max rank, MBGMV: per summed rank)
    beta: float  # ms, fixed cost of a step
    r2: float | None = None  # goodness of the fit it came from (bench/decode_profile.py); None: not fitted

    def __post_init__(self) -> None:
        for name in ("alpha", "beta"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ValueError(f"kernel cost {name} must be a finite number >= 0, got {value!r}")
        if self.r2 is not None and (isinstance(self.r2, bool) or not isinstance(self.r2, (int, float))
                                    or not math.isfinite(self.r2) or self.r2 > 1):
            raise ValueError(f"kernel cost r2 must be a finite number <= 1, got {self.r2!r}")


@dataclass(frozen=True, slots=True)
class PerfProfile:
    bgmv: KernelCost = field(default_factory=lambda: KernelCost(alpha=0.0225, beta=4.0))
    mbgmv: KernelCost = field(default_factory=lambda: KernelCost(alpha=0.03, beta=4.0))

    def step_ms(self, kernel: Kernel, ranks: Seq[int]) -> float:
        """Predicted decode-step latency of a batch with these LoRA ranks."""
        return self.units_ms(kernel, lora_units(kernel, ranks))

    def units_ms(self, kernel: Kernel, units: float) -> float:
        """Predicted step latency for `units` of LoRA work (lora_units) under `kernel`."""
        if kernel not in KERNELS:
            raise ValueError(f"unknown kernel {kernel!r}; choose one of {', '.join(KERNELS)}")
        cost: KernelCost = getattr(self, kernel)
        return cost.alpha * units + cost.beta

    def to_dict(self) -> dict[str, dict[str, float]]:
        out: dict[str, dict[str, float]] = {}
        for k in KERNELS:
            cost = getattr(self, k)
            out[k] = {"alpha": cost.alpha, "beta": cost.beta, **({} if cost.r2 is None else {"r2": cost.r2})}
        return out

    @classmethod
    def from_dict(cls, raw: object) -> PerfProfile:
        """Validate a parsed profile; kernels left out keep their defaults."""
        if not isinstance(raw, dict):
            raise ValueError("a performance profile must be a JSON object")
        unknown = sorted(set(raw) - set(KERNELS))
        if unknown:
            raise ValueError(f"unknown kernels in profile: {unknown}; expected {list(KERNELS)}")
        costs = {}
        for kernel, entry in raw.items():
            if not isinstance(entry, dict) or not {"alpha", "beta"} <= set(entry) <= {"alpha", "beta", "r2"}:
                raise ValueError(f"profile entry {kernel!r} must be {{\"alpha\": ..., \"beta\": ...[, \"r2\": ...]}}")
            costs[kernel] = KernelCost(alpha=entry["alpha"], beta=entry["beta"], r2=entry.get("r2"))
        return cls(**costs)

    @classmethod
    def load(cls, path: str | Path) -> PerfProfile:
        return cls.from_dict(read_json_file(path))

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n")


class RankAwareRouter(Router):
    name: ClassVar[str] = "rank_aware"

    def __init__(self, profile: PerfProfile | None = None, *, kernel: Kernel = "mbgmv", slo_ms: float = 36.0,
                 penalty_ms: float = 1000.0, spread_k: float = SPREAD_K) -> None:
        if kernel not in KERNELS:
            raise ValueError(f"unknown kernel {kernel!r}; choose one of {', '.join(KERNELS)}")
        if not (slo_ms > 0 and penalty_ms >= 0 and spread_k >= 0):
            raise ValueError("slo_ms must be positive, penalty_ms and spread_k non-negative")
        self.profile = profile or PerfProfile()
        self.kernel: Kernel = kernel
        self.slo_ms = slo_ms
        self.penalty_ms = penalty_ms
        self.spread_k = spread_k

    def predicted_ms(self, request: RequestInfo, engine: EngineState) -> float:
        """Decode-step latency of `engine`'s batch with `request` added: the PERF model plus the
        step time it does not explain on that engine (unmodelled_ms)."""
        return self.profile.step_ms(self.kernel, self._ranks_with(request, engine)) + self.unmodelled_ms(engine)

    def unmodelled_ms(self, engine: EngineState) -> float:
        """How much longer the engine's recent steps took than the PERF model predicts for those
        same steps (moving averages of both): prefill chunks sharing the steps under continuous
        batching, sampling, a profile that drifted from the hardware. Never below 0 (an engine is
        not trusted to run faster than the fitted model); 0 before any step was observed."""
        if engine.step_ms <= 0:
            return 0.0
        return max(0.0, engine.step_ms - self.profile.units_ms(self.kernel, engine.step_units(self.kernel)))

    def _ranks_with(self, request: RequestInfo, engine: EngineState) -> list[int]:
        ranks = engine.batch_ranks()
        if request.adapter is not None and request.rank > 0:
            ranks.append(request.rank)
        return ranks

    def cost(self, request: RequestInfo, engine: EngineState) -> float:
        before = self.profile.step_ms(self.kernel, engine.batch_ranks()) + self.unmodelled_ms(engine)
        after = self.predicted_ms(request, engine)
        # Only the misses this placement causes: requests already missing at `before` (an engine
        # seen slower than the model) cost nothing more here than elsewhere. The running ones
        # also take the new request's prefill on one of their steps.
        prefill_ms = engine.prefill_ms_per_token * request.prompt_len
        caused = self.violations(request, engine, after, prefill_ms) - self.violations(None, engine, before)
        return after - before + self.penalty_ms * max(0, caused)

    def violations(self, request: RequestInfo | None, engine: EngineState, after_ms: float,
                   prefill_ms: float = 0.0) -> int:
        """How many requests of the batch, `request` included (when given), would miss the TPT SLO with steps of
        `after_ms`. A request's TPT is the mean of all its steps: those it ran (decode_ms over
        decoded_steps) and its n remaining ones, which scatter around the prediction (prefill
        chunks of later arrivals land on some of them). It misses when
            decode_ms + n·(after + k·σ_step/√n) > SLO·(decoded_steps + n),
        so short requests need headroom, long ones average the chunks out, and one that banked
        slack can absorb a slower step. σ = 0 (nothing observed) and no history: after > SLO.
        prefill_ms: one step of every running request is that much longer (a new request's prefill)."""
        slo = self.slo_ms if request is None or request.slo_ms is None else request.slo_ms
        spread = self.spread_k * engine.step_ms_std
        own = 0
        if request is not None:
            out = request.max_tokens if request.predicted_output is None else request.predicted_output
            own = int(_misses(after_ms, spread, slo, max(1, out), 0, 0.0))
        running = sum(_misses(after_ms, spread, slo, max(1, r.remaining_tokens), r.decoded_steps,
                              r.decode_ms + prefill_ms) for r in engine.running)
        waiting = sum(_misses(after_ms, spread, slo, max(1, r.remaining_tokens), r.decoded_steps, r.decode_ms)
                      for r in engine.waiting)
        return own + running + waiting

    def choose(self, request: RequestInfo, engines: Seq[EngineState]) -> int:
        return min(healthy(engines), key=lambda i: (self.cost(request, engines[i]),
                                                     self.predicted_ms(request, engines[i]),
                                                     engines[i].num_requests, i))


def _misses(step_ms: float, spread_ms: float, slo_ms: float, remaining: int, decoded: int, decode_ms: float) -> bool:
    """Whether a request ends above the SLO: `decoded` steps took `decode_ms`, `remaining` more
    take `step_ms` each, scattered by spread_ms/√remaining on their mean."""
    return decode_ms + remaining * step_ms + spread_ms * math.sqrt(remaining) > slo_ms * (decoded + remaining)
