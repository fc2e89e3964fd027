"""Per-request state the scheduler keeps between iterations (torch-free).

A sequence is prompt + output tokens with `num_computed` of them already in
its KV pages; prefill, chunked prefill, decode and recompute after preemption
are all "feed the uncomputed tail, sample when it is all computed".
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum

from loraplex.ipc.engine_plan import SamplingSpec


class SeqStatus(str, Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(frozen=True, slots=True)
class SeqRequest:
    request_id: str
    prompt_ids: list[int]
    adapter: str | None
    sampling: SamplingSpec
    max_tokens: int
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    ttft_slo_s: float | None = None  # its own time-to-first-token SLO (early abort); None: the scheduler's


@dataclass(slots=True)
class Sequence:
    req: SeqRequest
    arrival: float = field(default_factory=time.monotonic)
    status: SeqStatus = SeqStatus.WAITING
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float | None] = field(default_factory=list)
    top_logprobs: list[dict[int, float]] = field(default_factory=list)  # per output token, when asked for
    kv_pages: list[int] = field(default_factory=list)
    num_computed: int = 0
    finish_reason: str | None = None
    first_scheduled: float | None = None
    first_token_at: float | None = None
    num_preemptions: int = 0
    waited_for_adapter: bool = False  # left queued while its adapter was copied (admit_when_loaded)
    # Prefix cache: leading kv_pages that are cached blocks, and whether later full pages may
    # still join (a page the cache already had under another page closes the chain).
    cached_blocks: int = 0
    prefix_open: bool = True
    # Sliding-window models (SchedulerConfig.kv_window): leading kv_pages given back to the pool as
    # wholly out of the window; their entries are KvPages.placeholder, a page no sequence owns.
    released_pages: int = 0
    cached_tokens: int = 0  # prompt tokens whose KV came from the cache at its first admission
    expected_cached: int = 0  # prompt tokens the cache held when it was queued (what policies cost)

    @property
    def request_id(self) -> str:
        return self.req.request_id

    @property
    def num_tokens(self) -> int:
        return len(self.req.prompt_ids) + len(self.output_ids)

    def token_slice(self, start: int, stop: int) -> list[int]:
        """Tokens [start, stop) of prompt + output, without joining the two (a decode row
        used to copy the whole prompt every step)."""
        prompt = self.req.prompt_ids
        n = len(prompt)
        if stop <= n:
            return prompt[start:stop]
        if start >= n:
            return self.output_ids[start - n:stop - n]
        return prompt[start:] + self.output_ids[:stop - n]

    @property
    def prefill_len(self) -> int:
        """Prompt tokens it is expected to compute: those the prefix cache did not hold when it arrived."""
        return len(self.req.prompt_ids) - self.expected_cached

    @property
    def num_uncomputed(self) -> int:
        return self.num_tokens - self.num_computed
