"""The host tier's bookkeeping: which adapters sit in the cache manager's host
store, how many bytes they take, which leave first when it is full.

Torch-free policy over extents the cache manager reports (disk -> host -> GPU).
Victims are least recently used first and never an adapter in `busy` (used by
a request in flight, or held by a GPU copy that is referenced) or pinned.
It never talks to a process: the serving core carries out its decisions.
"""
from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Iterable

TIERS = ("gpu", "host", "disk")


class HostTier:
    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        self.capacity = capacity_bytes
        self._resident: OrderedDict[str, int] = OrderedDict()  # name -> extent bytes, least recently used first
        self._pinned: set[str] = set()
        self.used = 0
        self.loads = 0  # disk -> host
        self.evictions = 0
        self.failures = 0  # loads refused (bad files) or that could not fit
        self.load_ms = 0.0
        self.restarts = 0  # cache manager restarts: the store was lost
        self.hits: Counter = Counter({tier: 0 for tier in TIERS})  # where each request found its adapter

    # ---- queries ------------------------------------------------------------------------
    def is_resident(self, name: str) -> bool:
        return name in self._resident

    def resident_names(self) -> list[str]:
        """Least recently used first."""
        return list(self._resident)

    def size_of(self, name: str) -> int:
        return self._resident.get(name, 0)

    @property
    def free(self) -> int:
        return self.capacity - self.used

    # ---- changes ------------------------------------------------------------------------
    def add(self, name: str, nbytes: int, load_ms: float = 0.0) -> None:
        """`name` was placed in the store, taking an extent of `nbytes`."""
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        self.remove(name)
        if self.used + nbytes > self.capacity:
            raise ValueError(f"adapter {name} ({nbytes} bytes) overflows the host tier "
                             f"({self.used} of {self.capacity} used)")
        self._resident[name] = nbytes
        self.used += nbytes
        self.loads += 1
        self.load_ms += load_ms

    def remove(self, name: str, *, evicted: bool = False) -> int:
        """`name` left the store; returns the bytes freed."""
        nbytes = self._resident.pop(name, None)
        if nbytes is None:
            return 0
        self.used -= nbytes
        self.evictions += evicted
        return nbytes

    def touch(self, name: str) -> None:
        """A request used `name`: most recently used now."""
        if name in self._resident:
            self._resident.move_to_end(name)

    def pin(self, name: str) -> None:
        self._pinned.add(name)

    def unpin(self, name: str) -> None:
        self._pinned.discard(name)

    def record_hit(self, tier: str) -> None:
        if tier not in TIERS:
            raise ValueError(f"tier must be one of {TIERS}, got {tier!r}")
        self.hits[tier] += 1

    def reset(self) -> None:
        """The store is gone (its cache manager died): nothing is host-resident."""
        self._resident.clear()
        self.used = 0
        self.restarts += 1

    # ---- policy -------------------------------------------------------------------------
    def victims(self, needed: int, free: int, busy: Iterable[str] = ()) -> list[str]:
        """Least recently used adapters, not busy and not pinned, whose extents together with
        `free` bytes cover `needed`; [] when even all of them would not (evict nothing).
        With `needed` <= `free` the free bytes are fragmented: the least recently used one."""
        excluded = set(busy) | self._pinned
        chosen: list[str] = []
        room = free
        for name, nbytes in self._resident.items():
            if name in excluded:
                continue
            chosen.append(name)
            if needed <= free:
                return chosen
            room += nbytes
            if room >= needed:
                return chosen
        return []

    def snapshot(self) -> dict[str, object]:
        return {"capacity_bytes": self.capacity, "used_bytes": self.used, "adapters": len(self._resident),
                "resident": list(self._resident)[-64:], "loads": self.loads, "evictions": self.evictions,
                "failures": self.failures, "load_ms": self.load_ms, "restarts": self.restarts,
                "hits": dict(self.hits)}
