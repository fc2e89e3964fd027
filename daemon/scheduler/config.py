"""Settings shared by every scheduling policy (torch-free).

Batch limits, the optional TTFT SLO that turns on early abort, and the
adapter-clustering option. Policy-specific knobs live beside their policy
(MlqConfig in mlq.py, DloraConfig in dlora.py). The defaults here are the
daemon's ([scheduler] takes them from here); a caller that wants no adapter
limit or no waiting for loads says so (max_loras_per_batch=0, admit_when_loaded=False).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from loraplex.contracts.engine_spec import DEFAULT_MAX_NUM_SEQS
from loraplex.daemon.gpu_cache.predictor import PredictorConfig

PREFIX_EVICTIONS = ("unified", "separate")
# scheduler.overlap's default, which the simulator plans by too: one step planned ahead of the engine
# (daemon/step_loop.py, depth 2); false runs the same loop synchronously.
DEFAULT_OVERLAP = True


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    max_batched_tokens: int = 2048
    max_model_len: int = 4096
    load_groups: int = 1  # layer groups a cold adapter is loaded in (1: all before use)
    # Most distinct adapters among running sequences; 0: no limit (checked when admitting).
    max_loras_per_batch: int = 64
    # S-LoRA 4.3 early abort: a queued request whose predicted time to first token exceeds
    # this many seconds is aborted (see admission.py). None: off, except for requests that
    # bring their own SeqRequest.ttft_slo_s.
    ttft_slo_s: float | None = None
    # S-LoRA 4.2 adapter clustering: admit requests whose adapter already runs first.
    cluster_adapters: bool = False
    # A request passed over this many times by clustering is admitted next regardless.
    cluster_max_skips: int = 32
    # A queued request whose adapter is still loading waits in the queue (its copy under way)
    # instead of stalling the whole step on it; the engine reports loads in StepResult.loading.
    # Off: it is admitted at once and the step waits for the adapter's layer groups.
    admit_when_loaded: bool = True
    # GPU adapter cache eviction policy (daemon/gpu_cache/policies.py): none, lru, fifo or cost.
    cache_policy: str = "lru"
    # Prefetch adapters of queued requests into free pages (never evicting for it).
    prefetch: bool = True
    # Also prefetch adapters a histogram of past arrivals expects soon (daemon/gpu_cache/predictor.py);
    # None: off (the default).
    cache_predictor: PredictorConfig | None = None
    # Automatic prefix caching (daemon/memory/prefix_cache.py): full KV pages stay cached after
    # their sequence and are reused by a later prompt with the same prefix and adapter.
    prefix_cache: bool = True
    # How cached prefix pages and idle adapters share the pool: "unified", one order for both
    # (whichever was used longer ago leaves first); "separate", the prefix cache holds at most
    # prefix_cache_share of the pool and idle adapters leave before any prefix page does.
    prefix_eviction: str = "unified"
    prefix_cache_share: float = 0.5
    # The sliding window, in tokens, of every attention layer of the model (the engine reports it:
    # EngineHello.kv_window); None where some layer sees its whole context. With one, the KV pages
    # wholly before the window of a sequence's next token go back to the pool (kv_pages.py), and the
    # prefix cache is off (prefix_reuse.py says why).
    kv_window: int | None = None

    def __post_init__(self) -> None:
        if min(self.max_num_seqs, self.max_batched_tokens, self.max_model_len, self.load_groups) <= 0:
            raise ValueError("scheduler limits must be positive")
        if self.max_loras_per_batch < 0:
            raise ValueError("max_loras_per_batch must be >= 0 (0: no limit)")
        if self.ttft_slo_s is not None and not (math.isfinite(self.ttft_slo_s) and self.ttft_slo_s > 0):
            raise ValueError(f"ttft_slo_s must be a positive number of seconds, got {self.ttft_slo_s!r}")
        if self.prefix_eviction not in PREFIX_EVICTIONS:
            raise ValueError(f"prefix_eviction must be one of {PREFIX_EVICTIONS}, got {self.prefix_eviction!r}")
        if not (0.0 < self.prefix_cache_share <= 1.0):
            raise ValueError(f"prefix_cache_share must be in (0, 1], got {self.prefix_cache_share!r}")
        if self.kv_window is not None and self.kv_window <= 0:
            raise ValueError(f"kv_window must be a positive number of tokens or None, got {self.kv_window!r}")
        if self.cluster_max_skips <= 0:
            raise ValueError("cluster_max_skips must be positive")
