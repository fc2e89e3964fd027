"""The GPU validation as one ordered plan of steps, for a single device window.

Every stage module lists its steps (`steps()`), each with a tier and the time it
is expected to take on one H100/H200 with a cold Triton cache. `--window S`
runs the steps of all stages by tier, most valuable first:

1. build: install, the extension, every Triton kernel compiled on the device;
2. correctness: kernels against their references at real size, CUDA-graph
   decode against eager, the offline API and a daemon against transformers +
   PEFT, cpu_assist against on_demand, the GPU test files;
3. headline figures: the 7B decode step with 64 adapters over base-only, TTFT
   of the three load modes, adapter load over pinned H2D, BGMV/MBGMV bandwidth;
4. the rest, as time allows: graphs off, the perf-model fit, the 8B shape, the
   many-core CPU stage.

Each step's result is written as soon as it is known (every stage's JSON is
rewritten after every step), so a call killed at its limit still leaves JSON.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from .harness import StageContext

TIERS = {1: "build", 2: "correctness", 3: "headline figures", 4: "the rest"}


@dataclass(frozen=True, slots=True)
class Step:
    stage: str
    name: str
    tier: int
    est_s: float  # on one H100/H200, cold Triton cache
    run: Callable[[StageContext], None]
    order: int = 0  # place within its tier across all stages


def ordered(steps: list[Step]) -> list[Step]:
    """By tier, then by each step's place in its tier (stable: ties keep the stages' order)."""
    return sorted(steps, key=lambda s: (s.tier, s.order))


def plan_table(steps: list[Step], window_s: float) -> list[dict]:
    """The planned order with the expected start of each step, and whether it fits the window."""
    rows, at = [], 0.0
    for step in ordered(steps):
        rows.append({"stage": step.stage, "name": step.name, "tier": step.tier, "tier_name": TIERS[step.tier],
                     "est_s": step.est_s, "starts_at_s": round(at), "fits": at + step.est_s <= window_s})
        at += step.est_s
    return rows
