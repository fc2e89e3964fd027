"""Histogram predictor of upcoming adapter use, for prefetching (off by default).

Per adapter it keeps the arrival times of a sliding window and a histogram of
the gaps between consecutive arrivals. With e seconds since the last arrival,
P(next arrival within T) = #gaps in (e, e+T] / #gaps > e (the empirical hazard
of the gap distribution). Torch-free, bounded memory; it never places anything.
"""
from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class PredictorConfig:
    """window_s: arrivals older than this are forgotten; horizon_s: T above;
    bin_s: histogram bin width; min_gaps: fewer gaps seen, no prediction;
    threshold: predict when the probability reaches it; max_events: arrivals kept per adapter."""

    window_s: float = 600.0
    horizon_s: float = 5.0
    bin_s: float = 0.25
    min_gaps: int = 3
    threshold: float = 0.5
    max_events: int = 256

    def __post_init__(self) -> None:
        if min(self.window_s, self.horizon_s, self.bin_s) <= 0:
            raise ValueError("predictor window_s, horizon_s and bin_s must be positive")
        if self.min_gaps < 1 or self.max_events < 2:
            raise ValueError("predictor min_gaps must be >= 1 and max_events >= 2")
        if not 0.0 < self.threshold <= 1.0:
            raise ValueError("predictor threshold must be in (0, 1]")


class ArrivalPredictor:
    def __init__(self, config: PredictorConfig | None = None) -> None:
        self.config = config or PredictorConfig()
        self._arrivals: dict[str, deque[float]] = {}
        self._gaps: dict[str, Counter[int]] = {}  # gap bin -> count, for gaps between kept arrivals

    def _bin(self, gap: float) -> int:
        return int(gap / self.config.bin_s)

    def _drop_oldest(self, name: str) -> None:
        arrivals, gaps = self._arrivals[name], self._gaps[name]
        first = arrivals.popleft()
        if arrivals:
            b = self._bin(arrivals[0] - first)
            gaps[b] -= 1
            if not gaps[b]:
                del gaps[b]

    def _expire(self, name: str, now: float) -> None:
        arrivals = self._arrivals[name]
        while arrivals and arrivals[0] < now - self.config.window_s:
            self._drop_oldest(name)
        if not arrivals:
            del self._arrivals[name], self._gaps[name]

    def record(self, name: str, now: float) -> None:
        """One request for `name` arrived at `now` (times must not go backwards per adapter)."""
        arrivals = self._arrivals.setdefault(name, deque())
        gaps = self._gaps.setdefault(name, Counter())
        if arrivals:
            gaps[self._bin(max(0.0, now - arrivals[-1]))] += 1
        arrivals.append(now)
        if len(arrivals) > self.config.max_events:
            self._drop_oldest(name)

    def forget(self, name: str) -> None:
        self._arrivals.pop(name, None)
        self._gaps.pop(name, None)

    def probability(self, name: str, now: float) -> float:
        """P(a request for `name` arrives within horizon_s of `now`); 0 with too little history."""
        if name not in self._arrivals:
            return 0.0
        self._expire(name, now)
        gaps = self._gaps.get(name)
        if not gaps or sum(gaps.values()) < self.config.min_gaps:
            return 0.0
        idle = now - self._arrivals[name][-1]
        w = self.config.bin_s
        survivors = within = 0
        for b, count in gaps.items():
            centre = (b + 0.5) * w
            if centre > idle:
                survivors += count
                if centre <= idle + self.config.horizon_s:
                    within += count
        return within / survivors if survivors else 0.0

    def predict(self, now: float) -> list[str]:
        """Adapters likely to be requested within horizon_s, most likely first."""
        scored = [(p, name) for name in list(self._arrivals)
                  if (p := self.probability(name, now)) >= self.config.threshold]
        scored.sort(key=lambda pn: (-pn[0], pn[1]))
        return [name for _, name in scored]
