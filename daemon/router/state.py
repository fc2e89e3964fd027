"""What routers see and decide (torch-free plain data): a request to place, a
snapshot of each engine replica, and request-adapter migrations.

Snapshots are built by the daemon from its per-engine schedulers; routers
never touch live scheduler objects, so the same routers run in the simulator.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from loraplex.contracts.engine_spec import DEFAULT_MAX_NUM_SEQS


def lora_units(kernel: str, ranks: Sequence[int]) -> float:
    """A batch's LoRA work in the units a kernel's cost grows with: BGMV pads every row to the
    largest rank (rows × max rank), MBGMV runs each row at its own rank (Σ rank)."""
    if kernel == "bgmv":
        return len(ranks) * max(ranks, default=0)
    if kernel == "mbgmv":
        return sum(ranks)
    raise ValueError(f"unknown kernel {kernel!r}; choose bgmv or mbgmv")


@dataclass(frozen=True, slots=True)
class RequestInfo:
    """A request to place on an engine."""

    request_id: str
    adapter: str | None
    rank: int = 0  # LoRA rank of its adapter (0: base model)
    prompt_len: int = 0
    max_tokens: int = 0
    predicted_output: int | None = None  # tokens it is expected to generate (max_tokens when unknown)
    adapter_bytes: int = 0  # bytes to move to an engine that does not hold the adapter
    slo_ms: float | None = None  # per-step (time per output token) SLO; the router's default when None

    @property
    def work_tokens(self) -> int:
        out = self.max_tokens if self.predicted_output is None else self.predicted_output
        return self.prompt_len + out


@dataclass(frozen=True, slots=True)
class EngineRequest:
    """A request an engine already holds."""

    request_id: str
    adapter: str | None
    rank: int = 0
    remaining_tokens: int = 0  # prompt tokens not yet computed + predicted output tokens still to come
    adapter_bytes: int = 0
    # Its TPT so far: decode steps since its first token, and the milliseconds they took (0, 0:
    # not decoding yet). A request that has banked slack can take slower steps, one that ran
    # late needs faster ones: its TPT is the mean over all its steps, not the remaining ones.
    decoded_steps: int = 0
    decode_ms: float = 0.0


@dataclass(frozen=True, slots=True)
class EngineState:
    """One engine replica as the router sees it."""

    engine_id: int
    running: tuple[EngineRequest, ...] = ()
    waiting: tuple[EngineRequest, ...] = ()
    resident_adapters: frozenset[str] = frozenset()
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    free_pages: int = 0
    total_pages: int = 0
    tokens_per_s: float = 1000.0  # measured processing rate (prefill and decode tokens per second)
    load_bytes_per_s: float = 0.0  # host -> GPU link; 0 when unknown (adapter loads then count as free)
    healthy: bool = True
    step_ms: float = 0.0  # recent observed step time (moving average, prefill chunks included); 0: unknown
    step_ms_std: float = 0.0  # spread of observed step times (prefill chunks come and go); 0: unknown
    # LoRA work of the same observed steps (moving averages, in lora_units of each kernel)
    step_bgmv_units: float = 0.0
    step_mbgmv_units: float = 0.0
    prefill_ms_per_token: float = 0.0  # what one more prefill token adds to a step (observed); 0: unknown

    @property
    def num_requests(self) -> int:
        return len(self.running) + len(self.waiting)

    @property
    def pending_tokens(self) -> int:
        return sum(r.remaining_tokens for r in self.running) + sum(r.remaining_tokens for r in self.waiting)

    def step_units(self, kernel: str) -> float:
        """The LoRA work of the steps behind `step_ms`, in `kernel`'s cost units."""
        return self.step_bgmv_units if kernel == "bgmv" else self.step_mbgmv_units

    def batch_ranks(self) -> list[int]:
        """Ranks of the LoRA requests that will share its decode batch (running and queued)."""
        return [r.rank for r in (*self.running, *self.waiting) if r.adapter is not None and r.rank > 0]

    def load_s(self, adapter: str | None, nbytes: int) -> float:
        """Seconds to bring `adapter` onto this engine (0 when resident, base or link unknown)."""
        if adapter is None or adapter in self.resident_adapters or self.load_bytes_per_s <= 0:
            return 0.0
        return nbytes / self.load_bytes_per_s


@dataclass(frozen=True, slots=True)
class Migration:
    """Move queued requests of one adapter from engine `source` to engine `target` (indices
    into the list given to `rebalance`); `load_adapter`: the target must load the adapter
    first (request-adapter co-migration)."""

    request_ids: tuple[str, ...]
    adapter: str | None
    source: int
    target: int
    load_adapter: bool
    moved_tokens: int
