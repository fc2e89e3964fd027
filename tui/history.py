"""Recent snapshots reduced to numbers, for derived rates and sparklines.

Owns the rolling window of flattened numeric stats (counters and gauges) and
the arithmetic on it: per-second rates of counters, gauge series for
sparklines. Pure Python, no I/O; a daemon restart (uptime going backwards)
starts the window afresh instead of producing negative rates.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from typing import Any, NamedTuple

from loraplex.tui.format import num

# List-valued stats flattened per entry, keyed by the field that names an entry.
LIST_KEYS = {"workers": "index", "engines": "index", "queues": "name"}
# Free-form maps whose keys are names, not metrics: not worth a time series.
SKIP_KEYS = frozenset({"requests_by_adapter", "adapter_paths", "finish_reasons", "recent_errors", "cache.adapters"})


class Sample(NamedTuple):
    t: float  # seconds on the daemon's clock (uptime) when it sends one, else receive time
    values: dict[str, float]


def flatten(stats: Mapping[str, Any], prefix: str = "", depth: int = 3) -> dict[str, float]:
    """Numeric leaves as dotted keys: latency.ttft_ms.p50, workers.2.tokens_per_s, ..."""
    out: dict[str, float] = {}
    for key, value in stats.items():
        name = f"{prefix}{key}"
        if name in SKIP_KEYS:
            continue
        v = num(value)
        if v is not None:
            out[name] = v
        elif isinstance(value, Mapping) and depth > 1:
            out.update(flatten(value, name + ".", depth - 1))
        elif isinstance(value, list) and name in LIST_KEYS:
            label = LIST_KEYS[name]
            for i, entry in enumerate(value):
                if isinstance(entry, Mapping):
                    out.update(flatten(entry, f"{name}.{entry.get(label, i)}.", depth - 1))
    return out


class History:
    """The last `window_s` seconds of samples (at most `max_samples`).

    rate(key): per-second increase of a counter over about `rate_window_s`.
    series(key): a gauge's values over the window, oldest first.
    rate_series(key): a counter's per-interval rates over the window.
    """

    def __init__(self, window_s: float = 300.0, rate_window_s: float = 5.0, max_samples: int = 2048) -> None:
        if not (window_s > 0 and rate_window_s > 0 and max_samples >= 2):
            raise ValueError("History needs window_s > 0, rate_window_s > 0 and max_samples >= 2")
        self.window_s = window_s
        self.rate_window_s = rate_window_s
        self._samples: deque[Sample] = deque(maxlen=max_samples)

    def __len__(self) -> int:
        return len(self._samples)

    def clear(self) -> None:
        self._samples.clear()

    def add(self, stats: Mapping[str, Any], received: float) -> None:
        """Record one snapshot; `received` is the local monotonic receive time."""
        uptime = num(stats.get("uptime_s"))
        t = uptime if uptime is not None else received
        if self._samples and t <= self._samples[-1].t:
            if t < self._samples[-1].t:
                self._samples.clear()  # the daemon restarted: its counters started again from zero
            else:
                self._samples.pop()  # same instant re-sent: keep the newer values
        self._samples.append(Sample(t, flatten(stats)))
        while self._samples and t - self._samples[0].t > self.window_s:
            self._samples.popleft()

    def latest(self, key: str) -> float | None:
        return self._samples[-1].values.get(key) if self._samples else None

    def rate(self, key: str) -> float | None:
        """Increase per second of counter `key` over the last ~rate_window_s;
        None without two samples carrying it or when it went backwards."""
        if len(self._samples) < 2:
            return None
        newest = self._samples[-1]
        end = newest.values.get(key)
        if end is None:
            return None
        base = None
        for sample in reversed(self._samples):
            if sample is newest or key not in sample.values:
                continue
            base = sample
            if newest.t - sample.t >= self.rate_window_s:
                break
        if base is None or newest.t <= base.t:
            return None
        delta = end - base.values[key]
        return delta / (newest.t - base.t) if delta >= 0 else None

    def series(self, key: str) -> list[float]:
        return [s.values[key] for s in self._samples if key in s.values]

    def rate_series(self, key: str) -> list[float]:
        out: list[float] = []
        prev: Sample | None = None
        for sample in self._samples:
            if key not in sample.values:
                continue
            if prev is not None and sample.t > prev.t:
                out.append(max(0.0, (sample.values[key] - prev.values[key]) / (sample.t - prev.t)))
            prev = sample
        return out

    @property
    def span_s(self) -> float:
        """Seconds covered by the window so far."""
        return self._samples[-1].t - self._samples[0].t if len(self._samples) > 1 else 0.0
