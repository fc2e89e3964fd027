"""The gateway's Prometheus registry: its own request counters and latency
histograms per model (base or adapter), the generations in flight, the
vLLM-compatible `vllm:lora_requests_info` gauge, and the daemon-derived
families (daemon_metrics).

Uses its own CollectorRegistry, never prometheus-client's global one, so two
gateways in one process (tests) never collide.
"""
from __future__ import annotations

import time
from collections import Counter as Tally
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric

from loraplex.gateway.daemon_metrics import DaemonCollector, DaemonStats
from loraplex.ipc.client_types import GenerateResult

TTFT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0)
TPOT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
                2.5, 5.0)
E2E_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0)
WAITING, RUNNING = "waiting", "running"


class Ticket:
    """One generation in flight: waiting until its first token arrives, then running."""

    __slots__ = ("_owner", "model", "adapter", "state")

    def __init__(self, owner: InFlight, model: str, adapter: str | None) -> None:
        self._owner = owner
        self.model = model
        self.adapter = adapter
        self.state: str | None = WAITING

    def running(self) -> None:
        if self.state == WAITING:
            self._owner._move(self, RUNNING)

    def done(self) -> None:
        if self.state is not None:
            self._owner._move(self, None)


class InFlight:
    """Counts of the gateway's generations in flight by (model, adapter, state)."""

    def __init__(self) -> None:
        self._counts: Tally[tuple[str, str | None, str]] = Tally()

    def start(self, model: str, adapter: str | None) -> Ticket:
        ticket = Ticket(self, model, adapter)
        self._counts[(model, adapter, WAITING)] += 1
        return ticket

    def _move(self, ticket: Ticket, state: str | None) -> None:
        key = (ticket.model, ticket.adapter, ticket.state)
        self._counts[key] -= 1
        if self._counts[key] <= 0:
            del self._counts[key]
        ticket.state = state
        if state is not None:
            self._counts[(ticket.model, ticket.adapter, state)] += 1

    def adapters(self, state: str) -> list[str]:
        """The adapters with a generation in `state`, sorted."""
        return sorted({a for (_, a, s), n in self._counts.items() if s == state and a is not None and n > 0})

    def by_model(self) -> list[tuple[str, str, int]]:
        per: Tally[tuple[str, str]] = Tally()
        for (model, _, state), n in self._counts.items():
            per[(model, state)] += n
        return [(model, state, n) for (model, state), n in sorted(per.items())]


class _LiveCollector:
    """Families computed at scrape time from the in-flight table."""

    def __init__(self, in_flight: InFlight, stats: DaemonStats, max_loras: int) -> None:
        self._in_flight = in_flight
        self._stats = stats
        self._max_loras = max_loras

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        gauge = GaugeMetricFamily("loraplex_gateway_requests_in_flight",
                                  "Generations in flight through the gateway (waiting: no token yet)",
                                  labels=["model", "state"])
        for model, state, n in self._in_flight.by_model():
            gauge.add_metric([model, state], n)
        yield gauge
        # As vLLM: the value is the current time; routers read the labels of the newest sample.
        info = GaugeMetricFamily("vllm:lora_requests_info", "Running stats on LoRA requests (vLLM-compatible)",
                                 labels=["running_lora_adapters", "waiting_lora_adapters", "max_lora"])
        running, waiting = self._daemon_adapters()
        info.add_metric([",".join(running), ",".join(waiting), str(self._max_lora())], time.time())
        yield info

    def _daemon_adapters(self) -> tuple[list[str], list[str]]:
        """The daemon's own view (every client's requests) when its stats carry it, else this gateway's."""
        snap = self._stats.snapshot or {}
        running, waiting = snap.get("running_adapters"), snap.get("waiting_adapters")
        if isinstance(running, list) and isinstance(waiting, list):
            return [str(a) for a in running], [str(a) for a in waiting]
        return list(self._in_flight.adapters(RUNNING)), list(self._in_flight.adapters(WAITING))

    def _max_lora(self) -> int:
        reported = (self._stats.snapshot or {}).get("max_loras_per_batch")
        if isinstance(reported, int) and not isinstance(reported, bool) and reported > 0:
            return reported
        return self._max_loras


class GatewayMetrics:
    """Everything /metrics shows; `exposition()` refreshes the daemon's stats and renders the text format."""

    def __init__(self, stats: DaemonStats, *, max_loras: int) -> None:
        self.stats = stats
        self.in_flight = InFlight()
        self.registry = CollectorRegistry(auto_describe=False)
        r = self.registry
        self.requests = Counter(
            "loraplex_gateway_requests", "HTTP generation requests by model (base or adapter; empty when unknown), "
            "endpoint and outcome: success, abort (the client went away) or the OpenAI error code",
            ["model", "endpoint", "outcome"], registry=r)
        self.success = Counter("loraplex_gateway_request_success", "Generations finished (one per prompt) by "
                               "finish reason", ["model", "finished_reason"], registry=r)
        self.prompt_tokens = Counter("loraplex_gateway_prompt_tokens", "Prompt tokens processed", ["model"],
                                     registry=r)
        self.generation_tokens = Counter("loraplex_gateway_generation_tokens", "Completion tokens generated",
                                         ["model"], registry=r)
        self.ttft = Histogram("loraplex_gateway_time_to_first_token_seconds", "Time to first token",
                              ["model"], buckets=TTFT_BUCKETS, registry=r)
        self.tpot = Histogram("loraplex_gateway_time_per_output_token_seconds", "Mean time per output token "
                              "after the first", ["model"], buckets=TPOT_BUCKETS, registry=r)
        self.e2e = Histogram("loraplex_gateway_e2e_request_latency_seconds", "Request latency in the daemon, "
                             "arrival to last token", ["model"], buckets=E2E_BUCKETS, registry=r)
        self.queue = Histogram("loraplex_gateway_queue_time_seconds", "Time from arrival to first scheduling",
                               ["model"], buckets=TTFT_BUCKETS, registry=r)
        r.register(_LiveCollector(self.in_flight, stats, max_loras))
        r.register(DaemonCollector(stats))

    def request(self, endpoint: str, model: str, outcome: str) -> None:
        """Count one HTTP generation request."""
        self.requests.labels(model, endpoint, outcome).inc()

    def finished(self, model: str, result: GenerateResult) -> None:
        """Count one finished generation and observe its timings (the daemon's milliseconds)."""
        self.success.labels(model, result.finish_reason).inc()
        self.prompt_tokens.labels(model).inc(result.usage.get("prompt_tokens", 0))
        self.generation_tokens.labels(model).inc(result.usage.get("completion_tokens", 0))
        t = result.timings
        observed = [("ttft_ms", self.ttft), ("e2e_ms", self.e2e), ("queue_ms", self.queue)]
        if result.usage.get("completion_tokens", 0) > 1:  # as vLLM: no per-token time for a single token
            observed.append(("tpt_ms", self.tpot))
        for key, histogram in observed:
            value = t.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0:
                histogram.labels(model).observe(value / 1e3)

    async def exposition(self) -> bytes:
        await self.stats.refresh()
        return generate_latest(self.registry)
