"""Build the router's view of one engine (EngineState) from its live scheduler.

Shared by the daemon and the simulator so both route on the same picture:
remaining work per request (uncomputed prompt + output still to come), the
batch's LoRA ranks, resident adapters and free pages. Torch-free.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Callable

from loraplex.daemon.router.state import EngineRequest, EngineState, lora_units

# Weight of the newest step in the observed step-time averages. Fast on purpose: the time the
# PERF model does not explain is mostly the prefill chunks in flight now, and routing away from
# an engine busy with a long prompt is what keeps its decoding requests within the SLO
# (the toppings-cluster sweep of this weight is in bench/RESULTS.md).
STEP_EMA = 0.4
# The spread is taken over a longer memory (~1/SPREAD_EMA steps): prefill chunks land on a few
# steps in ten, and a five-step window would see most of them as a change of level.
SPREAD_EMA = 0.05


@dataclass(slots=True)
class StepTimes:
    """Observed steps of one engine, for rank_aware: moving averages of the step time and of
    the same steps' LoRA work in each kernel's cost units (so the router can tell how much of
    the time its PERF model does not explain: prefill chunks, sampling), an exponentially
    weighted standard deviation of step times (its SLO margin), and the step time one more
    prefill token adds (an exponentially weighted regression of step time on the step's
    StepPlan.prefill_tokens). The first step starts them."""

    mean_ms: float = 0.0
    bgmv_units: float = 0.0
    mbgmv_units: float = 0.0
    _slow_mean_ms: float = 0.0
    _var_ms2: float = 0.0
    _prefill_mean: float = 0.0
    _prefill_var: float = 0.0
    _cov: float = 0.0  # of step time and prefill tokens

    def observe(self, step_ms: float, lora_ranks: Sequence[int] = (), prefill_tokens: int = 0) -> None:
        """One step of `step_ms` whose rows ran LoRA at `lora_ranks` (merged or base rows left out)
        and `prefill_tokens` tokens beyond one per row."""
        bgmv, mbgmv = lora_units("bgmv", lora_ranks), lora_units("mbgmv", lora_ranks)
        if self.mean_ms <= 0:
            self.mean_ms = self._slow_mean_ms = step_ms
            self.bgmv_units, self.mbgmv_units = bgmv, mbgmv
            self._prefill_mean = prefill_tokens
            return
        self.mean_ms += STEP_EMA * (step_ms - self.mean_ms)
        self.bgmv_units += STEP_EMA * (bgmv - self.bgmv_units)
        self.mbgmv_units += STEP_EMA * (mbgmv - self.mbgmv_units)
        diff = step_ms - self._slow_mean_ms
        dprefill = prefill_tokens - self._prefill_mean
        self._slow_mean_ms += SPREAD_EMA * diff
        self._prefill_mean += SPREAD_EMA * dprefill
        self._var_ms2 = (1 - SPREAD_EMA) * (self._var_ms2 + SPREAD_EMA * diff * diff)
        self._prefill_var = (1 - SPREAD_EMA) * (self._prefill_var + SPREAD_EMA * dprefill * dprefill)
        self._cov = (1 - SPREAD_EMA) * (self._cov + SPREAD_EMA * diff * dprefill)

    @property
    def ms_per_prefill_token(self) -> float:
        """Step time one more prefill token adds (slope of step time on prefill tokens; 0 until
        steps with and without prefill were both seen)."""
        if self._prefill_var <= 1e-9:
            return 0.0
        return max(0.0, self._cov / self._prefill_var)

    @property
    def std_ms(self) -> float:
        return math.sqrt(self._var_ms2)


def remaining_tokens(seq) -> int:
    """Prompt tokens not yet computed plus output tokens still to come (at most max_tokens)."""
    return seq.num_uncomputed + max(0, seq.req.max_tokens - len(seq.output_ids) - 1)


def engine_state(index: int, scheduler, *, rank_of: Callable[[str], int], bytes_of: Callable[[str, int], int],
                 max_num_seqs: int, total_pages: int, tokens_per_s: float, load_bytes_per_s: float,
                 healthy: bool = True, steps: StepTimes | None = None, now: float | None = None) -> EngineState:
    """`scheduler`: a daemon.scheduler BaseScheduler; `rank_of(adapter)`; `bytes_of(adapter, rank)`:
    bytes an engine without the adapter must load; `now`: the scheduler's clock, for each running
    request's TPT so far (None: left out)."""

    def view(seq) -> EngineRequest:
        adapter = seq.req.adapter
        rank = 0 if adapter is None else rank_of(adapter)
        decoded, decode_ms = 0, 0.0
        if now is not None and seq.first_token_at is not None and len(seq.output_ids) > 1:
            decoded, decode_ms = len(seq.output_ids) - 1, max(0.0, now - seq.first_token_at) * 1e3
        return EngineRequest(seq.request_id, adapter, rank, remaining_tokens(seq),
                             0 if adapter is None else bytes_of(adapter, rank), decoded, decode_ms)

    return EngineState(engine_id=index, running=tuple(view(s) for s in scheduler.running),
                       waiting=tuple(view(s) for s in scheduler.waiting),
                       resident_adapters=frozenset(scheduler.adapters.resident_names()),
                       max_num_seqs=max_num_seqs, free_pages=free_pages(scheduler), total_pages=total_pages,
                       tokens_per_s=tokens_per_s, load_bytes_per_s=load_bytes_per_s, healthy=healthy,
                       step_ms=0.0 if steps is None else steps.mean_ms,
                       step_ms_std=0.0 if steps is None else steps.std_ms,
                       step_bgmv_units=0.0 if steps is None else steps.bgmv_units,
                       step_mbgmv_units=0.0 if steps is None else steps.mbgmv_units,
                       prefill_ms_per_token=0.0 if steps is None else steps.ms_per_prefill_token)


def free_pages(scheduler) -> int:
    """Pages a request could have now in `scheduler`'s pool: free ones and cached prefix pages nobody holds."""
    idle = 0 if scheduler.prefix is None else scheduler.prefix.idle_pages
    return scheduler.allocator.num_free + idle
