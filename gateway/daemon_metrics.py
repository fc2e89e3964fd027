"""Prometheus families derived from the daemon's `stats` snapshot: queues,
daemon counters, recent latency, pool pages, adapter cache hit rates, PCIe
traffic and CPU-assist worker utilisation.

The snapshot is polled at scrape time with a short timeout and cached for
`cache_s`, so many scrapers cost the daemon one stats call per window.
Reading is defensive: a key the daemon does not report yields no family.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from loraplex.ipc.errors import LoraplexError

log = logging.getLogger("loraplex.gateway")
Snapshot = Mapping[str, Any]
# The daemon's latency windows (milliseconds) exported as recent quantiles.
_LATENCY_KINDS = ("ttft_ms", "tpt_ms", "e2e_ms", "step_ms", "engine_ms", "policy_ms")


class DaemonStats:
    """The latest stats snapshot (None while the daemon does not answer) and
    the CPU workers' utilisation between the last two snapshots."""

    def __init__(self, poll: Callable[[float], Awaitable[dict[str, object]]], *, timeout_s: float, cache_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._poll = poll
        self._timeout_s = timeout_s
        self._cache_s = cache_s
        self._clock = clock
        self._lock = asyncio.Lock()
        self._fetched_at: float | None = None
        self._busy: tuple[float, float] | None = None  # (time, cpu_assist busy_ms) of the previous snapshot
        self.snapshot: Snapshot | None = None
        self.worker_utilisation: float | None = None

    async def refresh(self) -> None:
        """Poll the daemon unless the current snapshot is younger than cache_s
        (concurrent scrapes share one poll)."""
        if self._fresh():
            return
        async with self._lock:
            if self._fresh():
                return
            try:
                snapshot: Snapshot | None = await self._poll(self._timeout_s)
            except LoraplexError as exc:
                log.debug("stats poll failed: %s", exc)
                snapshot = None
            self._fetched_at = self._clock()
            self.snapshot = snapshot
            self._utilisation(snapshot, self._fetched_at)

    def _fresh(self) -> bool:
        return self._fetched_at is not None and self._clock() - self._fetched_at < self._cache_s

    def _utilisation(self, snapshot: Snapshot | None, now: float) -> None:
        cpu = _map(snapshot, "cpu_assist")
        busy, workers = _num(cpu.get("busy_ms")), cpu.get("workers")
        if busy is None or not isinstance(workers, list) or not workers:
            self._busy, self.worker_utilisation = None, None
            return
        if self._busy is not None and now > self._busy[0] and busy >= self._busy[1]:
            ratio = (busy - self._busy[1]) / ((now - self._busy[0]) * 1e3 * len(workers))
            self.worker_utilisation = min(1.0, max(0.0, ratio))
        self._busy = (now, busy)


class DaemonCollector:
    """A prometheus-client collector over DaemonStats (refresh it before each scrape)."""

    def __init__(self, stats: DaemonStats) -> None:
        self._stats = stats

    def describe(self) -> list[Metric]:
        return []  # families depend on what the daemon reports

    def collect(self) -> Iterator[Metric]:
        s = self._stats.snapshot
        yield _gauge("loraplex_daemon_up", "1 if the daemon answered the last stats poll", 0.0 if s is None else 1.0)
        if s is None:
            return
        yield from _queues(s)
        yield from _counters(s)
        yield from _latency(s)
        yield from _pool(s)
        yield from _cache(s)
        yield from _pcie(s)
        yield from _cpu_assist(s, self._stats.worker_utilisation)


def _queues(s: Snapshot) -> Iterator[Metric]:
    running, waiting = _num(s.get("running")), _num(s.get("waiting"))
    if running is not None:
        yield _gauge("loraplex_num_requests_running", "Sequences in the daemon's running batch", running)
        yield _gauge("vllm:num_requests_running", "Requests running (vLLM-compatible)", running)
    if waiting is not None:
        yield _gauge("loraplex_num_requests_waiting", "Requests queued in the daemon", waiting)
        yield _gauge("vllm:num_requests_waiting", "Requests waiting (vLLM-compatible)", waiting)
    if (uptime := _num(s.get("uptime_s"))) is not None:
        yield _gauge("loraplex_daemon_uptime_seconds", "Seconds since the daemon started", uptime)


def _counters(s: Snapshot) -> Iterator[Metric]:
    for key, name, text in (
        ("requests", "loraplex_daemon_requests", "Requests the daemon accepted"),
        ("errors", "loraplex_daemon_request_errors", "Requests the daemon failed"),
        ("tokens", "loraplex_daemon_generation_tokens", "Tokens the daemon generated"),
        ("steps", "loraplex_daemon_steps", "Engine iterations"),
        ("engine_restarts", "loraplex_daemon_engine_restarts", "Engine process restarts"),
        ("preemptions", "loraplex_daemon_preemptions", "Sequences preempted for lack of pages"),
        ("adapter_placements", "loraplex_adapter_placements", "Adapters placed into the GPU pool"),
        ("adapter_evictions", "loraplex_adapter_evictions", "Adapters evicted from the GPU pool"),
    ):
        if (value := _num(s.get(key))) is not None:
            yield _counter(name, text, value)
    yield from _labelled(CounterMetricFamily, "loraplex_daemon_requests_finished",
                         "Requests the daemon finished, by finish reason", "finish_reason", _map(s, "finish_reasons"))
    yield from _labelled(CounterMetricFamily, "loraplex_daemon_requests_by_adapter",
                         "Requests the daemon accepted per adapter (<base>: none; the 64 busiest)", "adapter",
                         _map(s, "requests_by_adapter"))


def _latency(s: Snapshot) -> Iterator[Metric]:
    latency = _map(s, "latency")
    family = GaugeMetricFamily("loraplex_daemon_latency_seconds",
                               "Recent latency quantiles measured by the daemon (last 1024 samples)",
                               labels=["metric", "quantile"])
    for kind in _LATENCY_KINDS:
        window = latency.get(kind)
        if isinstance(window, Mapping) and _num(window.get("n")):
            for q, key in (("0.5", "p50"), ("0.99", "p99")):
                if (value := _num(window.get(key))) is not None:
                    family.add_metric([kind.removesuffix("_ms"), q], value / 1e3)
    if family.samples:
        yield family


def _pool(s: Snapshot) -> Iterator[Metric]:
    pool = _map(s, "pool")
    yield from _labelled(GaugeMetricFamily, "loraplex_pool_pages",
                         "Pages of the unified GPU pool: total, free, held by KV cache, held by adapters", "kind",
                         {k: pool.get(k) for k in ("total", "free", "kv", "adapter")})
    total, kv = _num(pool.get("total")), _num(pool.get("kv"))
    if total and kv is not None:
        # Both names: vLLM renamed gpu_cache_usage_perc to kv_cache_usage_perc (v1), and the
        # Gateway API Inference Extension's model-server protocol reads the new one.
        for name in ("vllm:gpu_cache_usage_perc", "vllm:kv_cache_usage_perc"):
            yield _gauge(name, "Fraction of the pool held by KV cache (vLLM-compatible)", kv / total)
    resident = s.get("resident_adapters")
    if isinstance(resident, list):
        yield _gauge("loraplex_resident_adapters", "Adapters resident in the GPU pool", len(resident))


def _cache(s: Snapshot) -> Iterator[Metric]:
    """Per tier hits/misses and hit ratio: the `cache` map's counts when the daemon
    reports one (plus any nested per-tier maps), else the GPU tier from request
    adapter paths (cached = hit; loaded or cpu_assisted = miss)."""
    paths = _map(s, "adapter_paths")
    yield from _labelled(CounterMetricFamily, "loraplex_adapter_path_requests",
                         "Finished requests by how their adapter was served (base, cached, loaded, cpu_assisted)",
                         "path", {k: v for k, v in paths.items() if k != "None"})
    tiers: dict[str, tuple[float, float]] = {}
    cache = _map(s, "cache")
    for tier, block in [("gpu", cache), *((k, v) for k, v in cache.items() if isinstance(v, Mapping))]:
        hits, misses = _num(block.get("hits")), _num(block.get("misses"))
        if hits is not None and misses is not None:
            tiers[tier] = (hits, misses)
    if "gpu" not in tiers:
        hits = _num(paths.get("cached")) or 0.0
        misses = (_num(paths.get("loaded")) or 0.0) + (_num(paths.get("cpu_assisted")) or 0.0)
        tiers["gpu"] = (hits, misses)
    hit_family = CounterMetricFamily("loraplex_adapter_cache_hits", "Adapter cache hits per tier", labels=["tier"])
    miss_family = CounterMetricFamily("loraplex_adapter_cache_misses", "Adapter cache misses per tier", labels=["tier"])
    ratio = GaugeMetricFamily("loraplex_adapter_cache_hit_ratio", "Adapter cache hit rate per tier (0 before any use)",
                              labels=["tier"])
    for tier, (hits, misses) in sorted(tiers.items()):
        hit_family.add_metric([tier], hits)
        miss_family.add_metric([tier], misses)
        ratio.add_metric([tier], hits / (hits + misses) if hits + misses else 0.0)
    yield from (hit_family, miss_family, ratio)
    if (evictions := _num(cache.get("evictions"))) is not None:
        yield _counter("loraplex_adapter_cache_evictions", "Adapters evicted by the cache policy", evictions)


def _pcie(s: Snapshot) -> Iterator[Metric]:
    pcie = _map(s, "pcie")
    totals = _map(pcie, "total_bytes")
    family = CounterMetricFamily("loraplex_pcie_transferred_bytes",
                                 "Bytes moved between host and GPU, by purpose and direction",
                                 labels=["purpose", "direction"])
    for purpose, nbytes in sorted(totals.items()):
        if (value := _num(nbytes)) is not None:
            direction = "d2h" if str(purpose).endswith("d2h") else "h2d"
            family.add_metric([str(purpose), direction], value)
    yield family
    rates = GaugeMetricFamily("loraplex_pcie_throughput_bytes_per_second",
                              "Host<->GPU traffic over the last 5 s", labels=["direction"])
    for direction in ("h2d", "d2h"):
        if (mb_s := _num(pcie.get(f"{direction}_mb_s"))) is not None:
            rates.add_metric([direction], mb_s * 1e6)
    if rates.samples:
        yield rates
    if (pct := _num(pcie.get("utilisation_pct"))) is not None:
        yield _gauge("loraplex_pcie_link_utilisation_ratio", "Busiest direction's share of the measured link rate",
                     pct / 100.0)


def _cpu_assist(s: Snapshot, utilisation: float | None) -> Iterator[Metric]:
    cpu = _map(s, "cpu_assist")
    if not cpu:
        return
    for key, name, text, scale in (
        ("jobs", "loraplex_cpu_assist_jobs", "CPU LoRA jobs submitted", 1.0),
        ("failures", "loraplex_cpu_assist_job_failures", "CPU LoRA jobs that failed", 1.0),
        ("cpu_rows", "loraplex_cpu_assist_rows", "Prefill rows computed with CPU assistance", 1.0),
        ("busy_ms", "loraplex_cpu_assist_busy_seconds", "Worker time spent on CPU LoRA jobs", 1e-3),
    ):
        if (value := _num(cpu.get(key))) is not None:
            yield _counter(name, text, value * scale)
    if utilisation is not None:
        yield _gauge("loraplex_cpu_workers_utilisation_ratio",
                     "Busy share of the CPU LoRA workers between the last two stats polls", utilisation)
    workers = [w for w in cpu.get("workers") or [] if isinstance(w, Mapping)]
    families = {
        "up": GaugeMetricFamily("loraplex_cpu_worker_up", "1 if the CPU LoRA worker process is alive",
                                labels=["worker"]),
        "pending": GaugeMetricFamily("loraplex_cpu_worker_pending_jobs", "Jobs queued on the worker",
                                     labels=["worker"]),
        "busy": GaugeMetricFamily("loraplex_cpu_worker_busy_ratio", "The worker's busy share, as it reports it",
                                  labels=["worker"]),
        "restarts": CounterMetricFamily("loraplex_cpu_worker_restarts", "Restarts of the worker process",
                                        labels=["worker"]),
    }
    for i, w in enumerate(workers):
        label = [str(w.get("index", i))]
        if isinstance(w.get("alive"), bool):
            families["up"].add_metric(label, 1.0 if w["alive"] else 0.0)
        if (pending := _num(w.get("pending"))) is not None:
            families["pending"].add_metric(label, pending)
        if (busy := _num(w.get("busy_pct"))) is not None:
            families["busy"].add_metric(label, busy / 100.0)
        restarts = _num(w.get("restarts"))
        if restarts is None and (starts := _num(w.get("starts"))) is not None:
            restarts = max(0.0, starts - 1)
        if restarts is not None:
            families["restarts"].add_metric(label, restarts)
    yield from (f for f in families.values() if f.samples)


# ---- helpers ------------------------------------------------------------------------------------
def _num(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def _map(parent: Mapping[str, Any] | None, key: str) -> Mapping[str, Any]:
    value = parent.get(key) if parent is not None else None
    return value if isinstance(value, Mapping) else {}


def _gauge(name: str, text: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, text, value=value)


def _counter(name: str, text: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, text, value=value)


def _labelled(kind: type[GaugeMetricFamily] | type[CounterMetricFamily], name: str, text: str, label: str,
              values: Mapping[str, object]) -> Iterator[Metric]:
    family = kind(name, text, labels=[label])
    for key, value in sorted(values.items(), key=lambda kv: str(kv[0])):
        if (number := _num(value)) is not None:
            family.add_metric([str(key)], number)
    if family.samples:
        yield family
