"""Serving metrics kept by the daemon: counters, recent latencies and step
times, rendered as the plain map that `stats` replies and the stats stream carry.

Torch-free; bounded memory (recent windows are fixed-size deques).
"""
from __future__ import annotations

import heapq
import time
from collections import Counter, deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from loraplex.ipc.engine_plan import StepPlan, StepResult
from loraplex.ipc.protocol import DoneReply

WINDOW = 1024
IN_FLIGHT_ROWS = 50  # requests listed in a snapshot, oldest first (`in_flight_total` counts them all)
RATE_WINDOW_S = 5.0  # MB/s figures are averaged over this many seconds
# purpose -> direction of the link it uses
TRANSFER_PURPOSES = {"adapter_h2d": ("adapter_loads", "h2d"), "assist_d2h": ("cpu_assist", "d2h"),
                     "assist_h2d": ("cpu_assist", "h2d")}


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
    transfer_totals: Counter = field(default_factory=Counter)
    transfers: deque = field(default_factory=lambda: deque(maxlen=4 * WINDOW))  # (time, key, bytes)
    link_bytes_per_s: float | None = None  # the GPU's measured H2D rate; None: no GPU (a CPU engine's is a memcpy)

    def accepted(self, adapter: str | None) -> None:
        self.requests += 1
        self.by_adapter[adapter or "<base>"] += 1

    def step(self, plan: StepPlan, result: StepResult, round_trip_ms: float, policy_ms: float) -> None:
        """round_trip_ms: plan sent -> result back; policy_ms: scheduling + result handling in the daemon."""
        self.steps += 1
        now = time.monotonic()
        for key, nbytes in result.transfer_bytes.items():
            if nbytes:
                self.transfer_totals[key] += nbytes
                self.transfers.append((now, key, nbytes))
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

    def pcie(self) -> dict[str, object]:
        """Host<->device traffic: MB/s over the last RATE_WINDOW_S seconds by direction and purpose."""
        now = time.monotonic()
        while self.transfers and now - self.transfers[0][0] > RATE_WINDOW_S:
            self.transfers.popleft()
        span = min(RATE_WINDOW_S, max(1e-3, now - self.started))
        rates: Counter = Counter()
        by_purpose: dict[str, dict[str, float]] = {}
        for _, key, nbytes in self.transfers:
            purpose, direction = TRANSFER_PURPOSES.get(key, (key, "h2d"))
            rates[direction] += nbytes
            by_purpose.setdefault(purpose, {"h2d_mb_s": 0.0,
                                            "d2h_mb_s": 0.0})[f"{direction}_mb_s"] += nbytes / span / 1e6
        h2d, d2h = rates["h2d"] / span / 1e6, rates["d2h"] / span / 1e6
        link = self.link_bytes_per_s / 1e6 if self.link_bytes_per_s else None
        return {"h2d_mb_s": h2d, "d2h_mb_s": d2h, "link_mb_s": link,
                "utilisation_pct": 100.0 * max(h2d, d2h) / link if link else None,
                "by_purpose": by_purpose, "total_bytes": dict(self.transfer_totals)}

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
            "pcie": self.pcie(),
            "mean_batch_rows": sum(self.batch_rows) / len(self.batch_rows) if self.batch_rows else 0.0,
            "control_overhead_ms": max(0.0, mean_step - mean_engine),
            "policy_ms_mean": sum(self.policy_ms) / len(self.policy_ms) if self.policy_ms else 0.0,
            **live,
        }


def queue_rows(slots: Iterable[Any]) -> list[dict[str, object]]:
    """The lanes of the engines' schedulers (MLQ's queues; none for FCFS or dLoRA) for the
    console's Queues panel; named `e<engine> q<level>` when more than one engine has lanes."""
    per_engine = [(slot.index, slot.scheduler.lanes()) for slot in slots if slot.scheduler is not None]
    with_lanes = [(index, lanes) for index, lanes in per_engine if lanes]
    if len(with_lanes) == 1:
        return with_lanes[0][1]
    return [{**lane, "name": f"e{index} {lane['name']}"} for index, lanes in with_lanes for lane in lanes]


def in_flight_rows(requests: Iterable[Any], schedulers: Iterable[Any], now: float,
                   limit: int = IN_FLIGHT_ROWS) -> list[dict[str, object]]:
    """The oldest `limit` requests in flight (daemon ClientRequests) for the console's list:
    the client's request id, adapter, state, tokens generated so far and age. State: queued
    (in an engine's queue), prefill or decode (in its batch), held (waiting for an engine or
    for its adapter's new weights, in no queue yet)."""
    state: dict[str, str] = {}
    for sched in schedulers:
        for seq in sched.waiting:
            state[seq.request_id] = "queued"
        for seq in sched.running:
            state[seq.request_id] = "prefill" if seq.num_computed < len(seq.req.prompt_ids) else "decode"
    return [{"id": r.request_id, "adapter": r.msg.adapter, "state": state.get(r.key, "held"),
             "tokens": len(r.token_ids), "age_s": max(0.0, now - r.arrival), "engine": r.engine}
            for r in heapq.nsmallest(limit, requests, key=lambda r: r.arrival)]
