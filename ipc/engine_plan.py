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
    # CPU-assisted prefill (docs/architecture.md, "The per-layer CPU/GPU protocol"): layers
    # [0, cpu_layers) of this row's LoRA delta are computed by CPU workers; its tokens occupy
    # exchange rows [cpu_row, cpu_row + len(token_ids)).
    cpu_layers: int = 0
    cpu_row: int = 0


@dataclass(frozen=True, slots=True)
class AdapterPlacement:
    """Copy adapter `name` from the host store into `pages` (see loraplex.contracts.geometry)."""

    name: str
    pages: list[int]
    # Load as this many layer groups, each signalling when it is in the pool (1: all at once).
    load_groups: int = 1


@dataclass(frozen=True, slots=True)
class CpuAssistStep:
    """The CPU side of one step: workers wait for ready words to reach `seq`;
    `workers_per_layer[l]` workers add 1 to each done word of layer l."""

    seq: int
    workers_per_layer: list[int]
    exchange_rows: int


@dataclass(frozen=True, slots=True)
class StepPlan:
    step_id: int
    rows: list[RowPlan]
    place: list[AdapterPlacement] = field(default_factory=list)
    evict: list[str] = field(default_factory=list)
    cpu: CpuAssistStep | None = None
    merged_adapter: str | None = None  # dLoRA merged mode: this adapter is folded into the base weights

    @property
    def num_tokens(self) -> int:
        return sum(len(r.token_ids) for r in self.rows)

    @property
    def prefill_tokens(self) -> int:
        """Tokens beyond one per row: the prefill work this step adds to a decode step."""
        return self.num_tokens - len(self.rows)


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
    # CPU-assist sites whose workers missed the deadline (the engine computed those deltas itself).
    cpu_timeouts: int = 0
    load_wait_ms: float = 0.0  # compute time spent waiting for adapter layer groups to arrive
    # Bytes moved over the host<->device link in this step, by purpose:
    # adapter_h2d (layer-group loads), assist_d2h (activations to the CPU workers), assist_h2d (their deltas).
    transfer_bytes: dict[str, int] = field(default_factory=dict)
    # Adapters placed by this or earlier plans whose layer groups are still arriving after this step.
    loading: list[str] = field(default_factory=list)
