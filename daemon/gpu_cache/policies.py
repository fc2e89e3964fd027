"""GPU adapter-cache eviction policies: none (S-LoRA), lru, fifo and cost (Chameleon §4.1).

Torch-free and stateless: a policy only orders the entries the residency hands it,
so switching policy at run time keeps every resident and its history. Policies
never evict, never look at references, pins or queues; the residency does that.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, Protocol, TypeVar


class UsageView(Protocol):
    """What a policy may read about one resident adapter."""

    @property
    def name(self) -> str: ...
    @property
    def num_pages(self) -> int: ...
    @property
    def placed_tick(self) -> int: ...  # logical time of placement (FIFO order)
    @property
    def last_used(self) -> float: ...  # clock seconds of the last acquire or release

    def frequency(self, now: float) -> float: ...  # decayed access count at `now`


E = TypeVar("E", bound=UsageView)


@dataclass(frozen=True, slots=True)
class CostWeights:
    """Chameleon's eviction score weights and the frequency window.

    frequency, recency, size: weights F, R, S (Chameleon §4.1: 0.45 / 0.10 / 0.45).
    half_life_s: accesses older than this count half in the decayed frequency.
    """

    frequency: float = 0.45
    recency: float = 0.10
    size: float = 0.45
    half_life_s: float = 60.0

    def __post_init__(self) -> None:
        if min(self.frequency, self.recency, self.size) < 0:
            raise ValueError("cost weights must be non-negative")
        if self.frequency + self.recency + self.size <= 0:
            raise ValueError("at least one cost weight must be positive")
        if not self.half_life_s > 0:
            raise ValueError("half_life_s must be positive")


class EvictionPolicy(ABC):
    """Orders resident adapters for eviction.

    Contract: `order(entries, now)` receives entries least recently used first and
    returns the same entries, the first to evict first; it is deterministic for
    equal inputs. `free_on_release` asks the residency to free an adapter's pages
    as soon as its last reference goes (no cache at all).
    """

    name: ClassVar[str]
    free_on_release: ClassVar[bool] = False

    @abstractmethod
    def order(self, entries: Sequence[E], now: float) -> list[E]: ...

    def scores(self, entries: Sequence[UsageView], now: float) -> dict[str, float] | None:
        """Per-adapter keep score for display (higher stays longer); None where the policy has none."""
        return None


class LruPolicy(EvictionPolicy):
    """Least recently used first (an acquire or a release counts as a use)."""

    name = "lru"

    def order(self, entries: Sequence[E], now: float) -> list[E]:
        return list(entries)


class NonePolicy(LruPolicy):
    """S-LoRA: no cache; the last release frees the pages. Adapters left resident by
    a switch from another policy, or by prefetch, leave least recently used first."""

    name = "none"
    free_on_release = True


class FifoPolicy(EvictionPolicy):
    """First placed, first evicted; uses do not refresh an adapter's place."""

    name = "fifo"

    def order(self, entries: Sequence[E], now: float) -> list[E]:
        return sorted(entries, key=lambda e: e.placed_tick)


class CostPolicy(EvictionPolicy):
    """Chameleon's cost-aware score; the lowest score is evicted first.

        score = F·freq + R·recency + S·size, each term in [0, 1] over the resident set
        passed in:
        freq    = percentile of the decayed access count: the share of the other
                  residents used less often (ties share the lower value). Accesses
                  halve in weight every `half_life_s`, and the count survives
                  evictions, so a popular adapter that comes back scores high at once.
                  A percentile rather than count / max: under power-law popularity
                  the head adapter's count dwarfs the rest, and count / max would
                  put nearly every adapter at ~0, leaving size alone to decide;
        recency = 1 - age / the largest age, age = now - last use (the most recently
                  used scores 1, the least recently used 0);
        size    = pages / the largest page count: a larger adapter costs more PCIe
                  time to bring back, so it is kept longer (the paper's intent).

    Ties go to the least recently used first.
    """

    name = "cost"

    def __init__(self, weights: CostWeights | None = None) -> None:
        self.weights = weights or CostWeights()

    def scores(self, entries: Sequence[UsageView], now: float) -> dict[str, float]:
        if not entries:
            return {}
        w = self.weights
        freqs = [e.frequency(now) for e in entries]
        ages = [max(0.0, now - e.last_used) for e in entries]
        max_age = max(ages)
        max_pages = max(e.num_pages for e in entries)
        ranked = sorted(freqs)
        out: dict[str, float] = {}
        for e, f, age in zip(entries, freqs, ages):
            below = bisect_left(ranked, f)  # residents used less often than this one
            freq = below / (len(entries) - 1) if len(entries) > 1 else float(f > 0)
            recency = 1.0 - age / max_age if max_age > 0 else 1.0
            size = e.num_pages / max_pages if max_pages > 0 else 0.0
            out[e.name] = w.frequency * freq + w.recency * recency + w.size * size
        return out

    def order(self, entries: Sequence[E], now: float) -> list[E]:
        scores = self.scores(entries, now)
        ranked = sorted(range(len(entries)), key=lambda i: (scores[entries[i].name], i))
        return [entries[i] for i in ranked]


POLICY_NAMES: tuple[str, ...] = ("none", "lru", "fifo", "cost")


def make_policy(name: str, weights: CostWeights | None = None) -> EvictionPolicy:
    """The policy called `name` (one of POLICY_NAMES); `weights` apply to cost only."""
    if name == "none":
        return NonePolicy()
    if name == "lru":
        return LruPolicy()
    if name == "fifo":
        return FifoPolicy()
    if name == "cost":
        return CostPolicy(weights)
    raise ValueError(f"unknown adapter eviction policy {name!r}; choose one of {', '.join(POLICY_NAMES)}")
