"""Per-adapter cache counters and usage history, kept across evictions.

Torch-free plain data. The residency updates these on every acquire, placement,
eviction and reported load; policies read the usage history (decayed frequency,
last use) through the resident entries. Nothing here decides anything.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

EVICTION_RATE_WINDOW_S = 10.0


@dataclass(slots=True)
class AdapterUsage:
    """History and counters of one adapter name.

    hits: acquires that found the adapter resident (prefetch_hits: of those, the
    first use of a prefetched copy); misses: acquires that had to place it;
    loads: placements of any kind (misses + prefetches); load_ms: load times the
    engine reported, over load_reports reports.
    """

    name: str
    half_life_s: float
    hits: int = 0
    misses: int = 0
    loads: int = 0
    prefetches: int = 0
    prefetch_hits: int = 0
    evictions: int = 0
    invalidations: int = 0
    load_ms: float = 0.0
    load_reports: int = 0
    last_used: float = 0.0
    _freq: float = 0.0  # decayed access count as of _freq_at
    _freq_at: float = 0.0

    def frequency(self, now: float) -> float:
        """Accesses weighted by 2^(-age / half_life_s)."""
        if self._freq == 0.0:
            return 0.0
        return self._freq * math.exp2(-max(0.0, now - self._freq_at) / self.half_life_s)

    def accessed(self, now: float) -> None:
        self._freq = self.frequency(now) + 1.0
        self._freq_at = now
        self.last_used = now

    def undo_access(self) -> None:
        """Take back the latest accessed() (an admission that was backed out)."""
        self._freq = max(0.0, self._freq - 1.0)

    def set_half_life(self, half_life_s: float, now: float) -> None:
        """Change the decay from `now` on, keeping today's value."""
        self._freq, self._freq_at = self.frequency(now), now
        self.half_life_s = half_life_s

    def load_ms_mean(self) -> float | None:
        return self.load_ms / self.load_reports if self.load_reports else None


@dataclass(slots=True)
class CacheTotals:
    hits: int = 0
    misses: int = 0
    loads: int = 0
    prefetches: int = 0
    prefetch_hits: int = 0
    evictions: int = 0
    invalidations: int = 0
    load_ms: float = 0.0
    load_reports: int = 0
    eviction_times: deque[float] = field(default_factory=lambda: deque(maxlen=4096))

    def hit_rate(self) -> float | None:
        n = self.hits + self.misses
        return self.hits / n if n else None

    def evictions_per_s(self, now: float) -> float:
        recent = sum(1 for t in self.eviction_times if now - t <= EVICTION_RATE_WINDOW_S)
        return recent / EVICTION_RATE_WINDOW_S

    def as_dict(self, now: float) -> dict[str, object]:
        return {
            "hit_rate": self.hit_rate(), "hits": self.hits, "misses": self.misses, "loads": self.loads,
            "prefetches": self.prefetches, "prefetch_hits": self.prefetch_hits, "evictions": self.evictions,
            "evictions_per_s": self.evictions_per_s(now), "invalidations": self.invalidations,
            "load_ms_total": self.load_ms,
            "load_ms_mean": self.load_ms / self.load_reports if self.load_reports else None,
        }
