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
Profile a real engine (bench) and pass its file for production use.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar, Literal
from typing import Sequence as Seq

from loraplex.daemon.router.base import Router, healthy
from loraplex.daemon.router.state import EngineState, RequestInfo
from loraplex.daemon.json_file import read_json_file

Kernel = Literal["bgmv", "mbgmv"]
KERNELS: tuple[str, ...] = ("bgmv", "mbgmv")
MAX_CALIBRATION = 4.0  # observed steps may run at most this many times the fitted prediction


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
        if kernel == "bgmv":
            cost = self.bgmv
            return cost.alpha * len(ranks) * (max(ranks) if ranks else 0) + cost.beta
        if kernel == "mbgmv":
            cost = self.mbgmv
            return cost.alpha * sum(ranks) + cost.beta
        raise ValueError(f"unknown kernel {kernel!r}; choose one of {', '.join(KERNELS)}")

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
                 penalty_ms: float = 1000.0) -> None:
        if kernel not in KERNELS:
            raise ValueError(f"unknown kernel {kernel!r}; choose one of {', '.join(KERNELS)}")
        if not (slo_ms > 0 and penalty_ms >= 0):
            raise ValueError("slo_ms must be positive and penalty_ms non-negative")
        self.profile = profile or PerfProfile()
        self.kernel: Kernel = kernel
        self.slo_ms = slo_ms
        self.penalty_ms = penalty_ms

    def predicted_ms(self, request: RequestInfo, engine: EngineState) -> float:
        """Decode-step latency of `engine`'s batch with `request` added, scaled by how much slower
        the engine's observed steps run than the LoRA cost model alone predicts (prefill chunks
        sharing the steps, or a profile that drifted from the hardware)."""
        return self.calibration(engine) * self.profile.step_ms(self.kernel, self._ranks_with(request, engine))

    def calibration(self, engine: EngineState) -> float:
        """observed / predicted step time of the running batch, within [1, MAX_CALIBRATION]; 1 when
        nothing has been observed. Never below 1: an idle-looking engine is not trusted to be faster
        than the fitted model."""
        if engine.step_ms <= 0 or not engine.running:
            return 1.0
        predicted = self.profile.step_ms(self.kernel, engine.running_ranks())
        return min(max(engine.step_ms / predicted, 1.0), MAX_CALIBRATION) if predicted > 0 else 1.0

    def _ranks_with(self, request: RequestInfo, engine: EngineState) -> list[int]:
        ranks = engine.batch_ranks()
        if request.adapter is not None and request.rank > 0:
            ranks.append(request.rank)
        return ranks

    def cost(self, request: RequestInfo, engine: EngineState) -> float:
        before = self.calibration(engine) * self.profile.step_ms(self.kernel, engine.batch_ranks())
        after = self.predicted_ms(request, engine)
        slo = self.slo_ms if request.slo_ms is None else request.slo_ms
        violating = engine.num_requests + 1 if after > slo else 0
        return after - before + self.penalty_ms * violating

    def choose(self, request: RequestInfo, engines: Seq[EngineState]) -> int:
        return min(healthy(engines), key=lambda i: (self.cost(request, engines[i]),
                                                     self.predicted_ms(request, engines[i]),
                                                     engines[i].num_requests, i))
