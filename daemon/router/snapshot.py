"""Build the router's view of one engine (EngineState) from its live scheduler.

Shared by the daemon and the simulator so both route on the same picture:
remaining work per request (uncomputed prompt + output still to come), the
batch's LoRA ranks, resident adapters and free pages. Torch-free.
"""
from __future__ import annotations

from typing import Callable

from loraplex.daemon.router.state import EngineRequest, EngineState


STEP_EMA = 0.2  # weight of the newest step in the observed step-time average


def step_ema(previous: float, step_ms: float) -> float:
    """Moving average of observed step times (the first observation starts it)."""
    return step_ms if previous <= 0 else (1 - STEP_EMA) * previous + STEP_EMA * step_ms


def remaining_tokens(seq) -> int:
    """Prompt tokens not yet computed plus output tokens still to come (at most max_tokens)."""
    return seq.num_uncomputed + max(0, seq.req.max_tokens - len(seq.output_ids) - 1)


def engine_state(index: int, scheduler, *, rank_of: Callable[[str], int], bytes_of: Callable[[str, int], int],
                 max_num_seqs: int, total_pages: int, tokens_per_s: float, load_bytes_per_s: float,
                 healthy: bool = True, step_ms: float = 0.0) -> EngineState:
    """`scheduler`: a daemon.scheduler BaseScheduler; `rank_of(adapter)`; `bytes_of(adapter, rank)`:
    bytes an engine without the adapter must load."""

    def view(seq) -> EngineRequest:
        adapter = seq.req.adapter
        rank = 0 if adapter is None else rank_of(adapter)
        return EngineRequest(seq.request_id, adapter, rank, remaining_tokens(seq),
                             0 if adapter is None else bytes_of(adapter, rank))

    return EngineState(engine_id=index, running=tuple(view(s) for s in scheduler.running),
                       waiting=tuple(view(s) for s in scheduler.waiting),
                       resident_adapters=frozenset(scheduler.adapters.resident_names()),
                       max_num_seqs=max_num_seqs, free_pages=scheduler.allocator.num_free, total_pages=total_pages,
                       tokens_per_s=tokens_per_s, load_bytes_per_s=load_bytes_per_s, healthy=healthy,
                       step_ms=step_ms)
