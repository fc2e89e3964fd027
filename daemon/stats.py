"""Serving metrics kept by the daemon: counters, recent latencies and step
times, rendered as the plain map that `stats` replies and the stats stream carry.

Torch-free; bounded memory (recent windows are fixed-size deques).
"""
from __future__ import annotations

import time
from collections import Counter, deque
from dataclasses import dataclass, field

from loraplex.ipc.engine_plan import StepPlan, StepResult
from loraplex.ipc.protocol import DoneReply

WINDOW = 1024


def _percentile(values: deque[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


@dataclass
class ServingStats:
    started: float = field(default_factory=time.monotonic)
    requests: int = 0
    completed: int = 0
    cancelled: int = 0
    errors: int = 0
    tokens: int = 0
    steps: int = 0
    engine_restarts: int = 0
    adapter_placements: int = 0
    adapter_evictions: int = 0
    cpu_timeouts: int = 0
    load_wait_ms: float = 0.0
    finish_reasons: Counter = field(default_factory=Counter)
    adapter_paths: Counter = field(default_factory=Counter)
    by_adapter: Counter = field(default_factory=Counter)
    ttft_ms: deque = field(default_factory=lambda: deque(maxlen=WINDOW))
    tpt_ms: deque = field(default_factory=lambda: deque(maxlen=WINDOW))
    e2e_ms: deque = field(default_factory=lambda: deque(maxlen=WINDOW))
    step_ms: deque = field(default_factory=lambda: deque(maxlen=WINDOW))
    engine_ms: deque = field(default_factory=lambda: deque(maxlen=WINDOW))
    batch_rows: deque = field(default_factory=lambda: deque(maxlen=WINDOW))
    policy_ms: deque = field(default_factory=lambda: deque(maxlen=WINDOW))

    def accepted(self, adapter: str | None) -> None:
        self.requests += 1
        self.by_adapter[adapter or "<base>"] += 1

    def step(self, plan: StepPlan, result: StepResult, round_trip_ms: float, policy_ms: float) -> None:
        """round_trip_ms: plan sent -> result back; policy_ms: scheduling + result handling in the daemon."""
        self.steps += 1
        self.cpu_timeouts += result.cpu_timeouts
        self.load_wait_ms += result.load_wait_ms
        self.step_ms.append(round_trip_ms)
        self.policy_ms.append(policy_ms)
        self.engine_ms.append(result.forward_ms + result.sample_ms)
        self.batch_rows.append(len(plan.rows))

    def placed(self, placements: int, evictions: int) -> None:
        self.adapter_placements += placements
        self.adapter_evictions += evictions

    def finished(self, done: DoneReply) -> None:
        if done.finish_reason == "cancelled":
            self.cancelled += 1
        else:
            self.completed += 1
        self.finish_reasons[done.finish_reason] += 1
        self.adapter_paths[str(done.timings.get("adapter_path"))] += 1
        for key, window in (("ttft_ms", self.ttft_ms), ("tpt_ms", self.tpt_ms), ("e2e_ms", self.e2e_ms)):
            value = done.timings.get(key)
            if isinstance(value, float):
                window.append(value)

    def snapshot(self, **live: object) -> dict[str, object]:
        uptime = time.monotonic() - self.started
        latency = {
            name: {"p50": _percentile(window, 0.5), "p99": _percentile(window, 0.99), "n": len(window)}
            for name, window in (("ttft_ms", self.ttft_ms), ("tpt_ms", self.tpt_ms), ("e2e_ms", self.e2e_ms),
                                 ("step_ms", self.step_ms), ("engine_ms", self.engine_ms),
                                 ("policy_ms", self.policy_ms))
        }
        mean_step = sum(self.step_ms) / len(self.step_ms) if self.step_ms else 0.0
        mean_engine = sum(self.engine_ms) / len(self.engine_ms) if self.engine_ms else 0.0
        return {
            "uptime_s": uptime,
            "requests": self.requests, "completed": self.completed, "cancelled": self.cancelled,
            "errors": self.errors, "tokens": self.tokens, "steps": self.steps,
            "engine_restarts": self.engine_restarts,
            "adapter_placements": self.adapter_placements, "adapter_evictions": self.adapter_evictions,
            "cpu_timeouts": self.cpu_timeouts, "load_wait_ms": self.load_wait_ms,
            "finish_reasons": dict(self.finish_reasons), "adapter_paths": dict(self.adapter_paths),
            "requests_by_adapter": dict(self.by_adapter.most_common(64)),
            "latency": latency,
            "mean_batch_rows": sum(self.batch_rows) / len(self.batch_rows) if self.batch_rows else 0.0,
            "control_overhead_ms": max(0.0, mean_step - mean_engine),
            "policy_ms_mean": sum(self.policy_ms) / len(self.policy_ms) if self.policy_ms else 0.0,
            **live,
        }
