"""The numbers the cluster moves around: each replica's routing stats (its requests in flight
with their ranks and remaining work, resident adapters on GPU and in the host tier, step time),
built from its own request table and its daemon's stats snapshot; and the ingress's view of the
whole cluster, the replicas' snapshots added up, so the gateway's /metrics reads it as one daemon's.

Plain dicts in and out (they cross Ray); nothing here talks to anything.
"""
from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from loraplex.contracts.engine_spec import DEFAULT_MAX_NUM_SEQS

MAX_LISTED = 256  # adapters listed per tier in one replica's routing stats


@dataclass(slots=True)
class Flight:
    """One request a replica forwarded to its daemon."""

    adapter: str | None
    prompt_len: int
    max_tokens: int
    generated: int = 0
    started: bool = False  # its first token arrived

    @property
    def remaining(self) -> int:
        return (0 if self.started else self.prompt_len) + max(0, self.max_tokens - self.generated)


@dataclass(slots=True)
class FlightTable:
    flights: dict[str, Flight] = field(default_factory=dict)

    def rows(self, running: bool, rank_of: Mapping[str, int]) -> list[list[Any]]:
        return [[f.adapter, rank_of.get(f.adapter, 0) if f.adapter else 0, f.remaining]
                for f in self.flights.values() if f.started == running]

    def adapters(self) -> set[str]:
        return {f.adapter for f in self.flights.values() if f.adapter}


def _num(value: object, default: float = 0.0) -> float:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else default


def routing_stats(flights: FlightTable, snapshot: Mapping[str, Any] | None, rank_of: Mapping[str, int],
                  *, healthy: bool) -> dict[str, Any]:
    """What the request router reads of one replica (RunningReplica.routing_stats)."""
    snap = snapshot or {}
    engines = [e for e in snap.get("engines") or [] if isinstance(e, Mapping)]
    step_ms = [_num(e.get("step_ms")) for e in engines if _num(e.get("step_ms")) > 0]
    rate = [_num(e.get("tokens_per_s")) for e in engines if _num(e.get("tokens_per_s")) > 0]
    host = snap.get("host_tier") if isinstance(snap.get("host_tier"), Mapping) else {}
    pool = snap.get("pool") if isinstance(snap.get("pool"), Mapping) else {}
    return {
        "at": time.time(),
        "healthy": healthy,
        "running": flights.rows(True, rank_of),
        "waiting": flights.rows(False, rank_of),
        "gpu": [str(a) for a in (snap.get("resident_adapters") or [])][:MAX_LISTED],
        "host": [str(a) for a in (host.get("resident") or [])][:MAX_LISTED],
        "ranks": {a: r for a, r in list(rank_of.items())[:4 * MAX_LISTED]},
        "step_ms": sum(step_ms) / len(step_ms) if step_ms else 0.0,
        "tokens_per_s": sum(rate) if rate else 0.0,  # 0: not measured yet (placement assumes the others' mean)
        "max_num_seqs": int(_num(snap.get("max_num_seqs"), DEFAULT_MAX_NUM_SEQS)) * max(1, len(engines)),
        # Cached prefix pages nobody holds are taken back as soon as a request needs room.
        "free_pages": int(_num(pool.get("free")) + _num(pool.get("prefix_cache"))),
        "total_pages": int(_num(pool.get("total"))),
    }


_SUMMED = ("running", "waiting", "requests", "completed", "cancelled", "errors", "tokens", "steps",
           "engine_restarts", "adapter_placements", "adapter_evictions", "preemptions", "in_flight_total")
_MERGED_MAPS = ("finish_reasons", "adapter_paths", "requests_by_adapter", "pool")
_UNIONS = ("running_adapters", "waiting_adapters", "resident_adapters")


def aggregate(snapshots: Iterable[Mapping[str, Any]]) -> dict[str, Any] | None:
    """The replicas' daemon snapshots as one: counts and per-key maps added, adapter lists
    united, max_loras_per_batch the smallest (what every replica can batch); None for none."""
    snaps = [s for s in snapshots if isinstance(s, Mapping)]
    if not snaps:
        return None
    out: dict[str, Any] = {}
    for key in _SUMMED:
        values = [s[key] for s in snaps if isinstance(s.get(key), (int, float)) and not isinstance(s.get(key), bool)]
        if values:
            out[key] = sum(values)
    for key in _MERGED_MAPS:
        merged: dict[str, float] = {}
        for s in snaps:
            for k, v in (s.get(key) or {}).items() if isinstance(s.get(key), Mapping) else ():
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    merged[str(k)] = merged.get(str(k), 0) + v
        if merged:
            out[key] = merged
    for key in _UNIONS:
        out[key] = sorted({str(a) for s in snaps for a in (s.get(key) or []) if isinstance(s.get(key), list)})
    limits = [s["max_loras_per_batch"] for s in snaps if isinstance(s.get("max_loras_per_batch"), int)]
    if limits:
        out["max_loras_per_batch"] = min(limits)
    uptime = [s["uptime_s"] for s in snaps if isinstance(s.get("uptime_s"), (int, float))]
    if uptime:
        out["uptime_s"] = min(uptime)
    return out
