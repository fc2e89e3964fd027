"""Shared material for the console tests (no tests here): crafted snapshots,
a recording fake admin client, and the screen as plain text."""
from __future__ import annotations

import io
from typing import Any

from rich.console import Console

from loraplex.ipc.client import AdapterInfo
from loraplex.ipc.errors import ErrorCode, LoraplexError


def base_snapshot(uptime: float = 3723.0, tokens: int = 12000, evictions: int = 10,
                  requests: int = 500) -> dict[str, Any]:
    """What today's daemon publishes (daemon/stats.py + ServingCore.snapshot)."""
    return {
        "uptime_s": uptime, "requests": requests, "completed": 480, "cancelled": 3, "errors": 2, "tokens": tokens,
        "steps": 9000, "engine_restarts": 1, "adapter_placements": 40, "adapter_evictions": evictions,
        "finish_reasons": {"stop": 300, "length": 180},
        "adapter_paths": {"cached": 350, "loaded": 50, "base": 80},
        "requests_by_adapter": {"qv-r8": 200, "<base>": 80},
        "latency": {"ttft_ms": {"p50": 12.5, "p99": 88.25, "n": 480}, "tpt_ms": {"p50": 4.25, "p99": 9.5, "n": 480},
                    "e2e_ms": {"p50": 420.0, "p99": 1800.0, "n": 480},
                    "step_ms": {"p50": 6.5, "p99": 14.0, "n": 1024}, "engine_ms": {"p50": 5.0, "p99": 12.0, "n": 1024},
                    "policy_ms": {"p50": 0.2, "p99": 0.9, "n": 1024}},
        "mean_batch_rows": 7.5, "control_overhead_ms": 1.2, "policy_ms_mean": 0.25,
        "running": 7, "waiting": 13, "pool": {"total": 600, "free": 180, "kv": 300, "adapter": 120},
        "resident_adapters": ["qv-r8", "all-r32", "mlp-r64"],
        "engine": {"index": 0, "pid": 42421, "alive": True, "starts": 2, "device": "cuda:0", "num_pages": 600},
        "engines": [{"index": 0, "pid": 42421, "alive": True, "healthy": True, "steps": 9000, "step_ms": 6.8,
                     "batch_rows": 7, "running": 7, "waiting": 13, "pool_used_pct": 70.0}],
        "draining": False, "preemptions": 4,
        "scheduler": "mlq", "cache_policy": "lru", "router": "most_idle", "load_mode": "on_demand", "workers": [],
        "in_flight": [{"id": "chat-7f3a", "adapter": "qv-r8", "state": "decode", "tokens": 212, "age_s": 9.5,
                       "engine": 0},
                      {"id": "lpx-0c41d2e9b6a8", "adapter": None, "state": "prefill", "tokens": 0, "age_s": 1.25,
                       "engine": 0},
                      {"id": "batch-0017", "adapter": "all-r32", "state": "queued", "tokens": 0, "age_s": 0.5,
                       "engine": 0}],
        "in_flight_total": 20,
    }


def full_snapshot(**kw: Any) -> dict[str, Any]:
    """base_snapshot plus every key later issues add (queues, cache, pcie, workers, engines, SLO, errors)."""
    s = base_snapshot(**kw)
    s.update({
        "queues": [
            {"name": "short", "depth": 5, "quota_used": 900, "quota_total": 1000, "oldest_wait_ms": 35.0,
             "wrs_cutoff": 0.25},
            {"name": "medium", "depth": 6, "quota_used": 300, "quota_total": 2000, "oldest_wait_ms": 120.0,
             "wrs_cutoff": 0.6},
            {"name": "long", "depth": 2, "quota_used": 0, "quota_total": 4000, "oldest_wait_ms": 2500.0,
             "wrs_cutoff": None},
        ],
        "cache": {"hit_rate": 0.875, "evictions_per_s": 0.5, "adapters": [
            {"name": "qv-r8", "rank": 8, "pages": 16, "refs": 2, "hits": 310, "score": 0.91},
            {"name": "all-r32", "rank": 32, "pages": 64, "refs": 0, "hits": 95, "score": 0.42},
            {"name": "mlp-r64", "rank": 64, "pages": 40, "refs": 1, "hits": 12, "score": 0.13}]},
        "pcie": {"h2d_mb_s": 812.0, "d2h_mb_s": 64.0, "link_mb_s": 25000.0,
                 "by_purpose": {"adapter": 700.0, "activations": 112.0}},
        "workers": [{"index": i, "pid": 5000 + i, "alive": True, "ready": True, "busy_pct": 20.0 * i,
                     "tokens_per_s": 100.0 * (i + 1), "restarts": i // 3} for i in range(4)],
        "load_mode": "cpu_assist",
        "engines": [{"index": 0, "step_ms": 6.5, "batch_rows": 7.5, "pool_used_pct": 70.0, "alive": True}],
        "slo_attainment": 0.975,
        "recent_errors": [{"time": 1700000000.0, "code": "overloaded", "message": "queue full"},
                          {"time": 1700000005.0, "code": "engine_failed", "message": "engine 0 died"}],
    })
    return s


class FakeAdmin:
    """Records every admin call; `fail` makes the next call raise that error."""

    def __init__(self, adapters: list[AdapterInfo] | None = None) -> None:
        self.calls: list[tuple[str, tuple[Any, ...]]] = []
        self.list_calls = 0
        self.fail: LoraplexError | None = None
        self.closed = False
        self._adapters = adapters if adapters is not None else [
            AdapterInfo("qv-r8", "/a/qv-r8", 8, ("q_proj", "v_proj"), "ready", {"pages": 16, "refs": 2}),
            AdapterInfo("all-r32", "/a/all-r32", 32, ("q_proj",), "ready", {"pages": 64, "refs": 0}),
        ]

    async def _record(self, name: str, *args: Any) -> dict[str, object]:
        self.calls.append((name, args))
        if self.fail is not None:
            error, self.fail = self.fail, None
            raise error
        return {"ok": True}

    async def add_adapter(self, name: str, path: str) -> dict[str, object]:
        return await self._record("add_adapter", name, path)

    async def remove_adapter(self, name: str) -> dict[str, object]:
        return await self._record("remove_adapter", name)

    async def pin_adapter(self, name: str, pinned: bool = True) -> dict[str, object]:
        return await self._record("pin_adapter", name, pinned)

    async def unpin_adapter(self, name: str) -> dict[str, object]:
        return await self._record("unpin_adapter", name)

    async def drain(self, timeout_s: float = 30.0) -> dict[str, object]:
        return await self._record("drain", timeout_s)

    async def set_policy(self, kind: Any, name: str) -> dict[str, object]:
        return await self._record("set_policy", kind, name)

    async def adapters(self, *, timeout: float | None = None) -> list[AdapterInfo]:
        self.list_calls += 1
        return list(self._adapters)

    async def close(self) -> None:
        self.closed = True


def not_found(message: str = "unknown adapter 'nope'") -> LoraplexError:
    return LoraplexError(ErrorCode.NOT_FOUND, message)


def screen_text(app: Any) -> str:
    """The whole current screen as plain text, one line per terminal row."""
    console = Console(width=app.size.width, height=app.size.height, file=io.StringIO(), color_system=None,
                      legacy_windows=False, no_color=True, record=True, force_terminal=False)
    console.print(app.screen._compositor.render_update(full=True))
    return console.export_text()
