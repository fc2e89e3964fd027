"""Daemon → engine step plans and engine → daemon step results.

The contract between policy (daemon, torch-free) and execution (gpu_engine):
the plan says which tokens run, where their KV lives, which adapter each row
uses and which adapters to place in which pages. Plain data only — tensors
never appear here, so the same objects travel over ZMQ as msgpack maps.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class SamplingSpec:
    """Per-request sampling; temperature 0 means greedy. Stateless: the engine
    derives the random stream of token k from (seed, k), so a recomputed request
    samples the same tokens."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int = 0
    logprobs: bool = False


@dataclass(frozen=True, slots=True)
class RowPlan:
    """One sequence in one step: `token_ids` are fed at positions
    `start_pos .. start_pos+len-1`; `kv_pages` is its whole page table."""

    request_id: str
    token_ids: list[int]
    start_pos: int
    kv_pages: list[int]
    adapter: str | None
    sample: bool
    sampling: SamplingSpec
    sample_index: int = 0  # how many tokens this request has sampled before


@dataclass(frozen=True, slots=True)
class AdapterPlacement:
    """Copy adapter `name` from the host store into `pages` (see daemon.memory.geometry)."""

    name: str
    pages: list[int]


@dataclass(frozen=True, slots=True)
class StepPlan:
    step_id: int
    rows: list[RowPlan]
    place: list[AdapterPlacement] = field(default_factory=list)
    evict: list[str] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(len(r.token_ids) for r in self.rows)


@dataclass(frozen=True, slots=True)
class RowResult:
    request_id: str
    token_id: int
    logprob: float | None


@dataclass(frozen=True, slots=True)
class StepResult:
    step_id: int
    rows: list[RowResult]
    forward_ms: float = 0.0
    sample_ms: float = 0.0
