"""Which adapters hold pages in the unified pool, and who uses them.

Torch-free. An adapter is placed on first use and reference-counted by the
sequences that run with it; at zero references it stays resident (a free
cache in otherwise idle pages) until the allocator needs the pages, then the
least recently used unreferenced adapter goes first. A referenced adapter is
never evicted.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from loraplex.daemon.memory.allocator import ADAPTER, OutOfPages, PageAllocator
from loraplex.ipc.engine_plan import AdapterPlacement


@dataclass(slots=True)
class ResidentAdapter:
    pages: list[int]
    refs: int = 0


@dataclass(slots=True)
class ResidencyChanges:
    """Placements and evictions to send to the engine with the next plan, in order:
    evictions first, so freed pages can be reused by placements of the same step."""

    place: list[AdapterPlacement] = field(default_factory=list)
    evict: list[str] = field(default_factory=list)


class AdapterResidency:
    def __init__(self, allocator: PageAllocator) -> None:
        self._alloc = allocator
        self._resident: OrderedDict[str, ResidentAdapter] = OrderedDict()  # LRU order, oldest first
        self.changes = ResidencyChanges()

    def is_resident(self, name: str) -> bool:
        return name in self._resident

    def refs(self, name: str) -> int:
        entry = self._resident.get(name)
        return 0 if entry is None else entry.refs

    def resident_names(self) -> list[str]:
        return list(self._resident)

    def reclaimable_pages(self) -> int:
        return sum(len(e.pages) for e in self._resident.values() if e.refs == 0)

    def acquire(self, name: str, num_pages: int, load_groups: int = 1) -> bool:
        """Reference `name`, placing it if needed; False when the pages cannot be found."""
        entry = self._resident.get(name)
        if entry is None:
            if not self.make_room(num_pages):
                return False
            entry = ResidentAdapter(pages=self._alloc.allocate(num_pages, ADAPTER))
            self._resident[name] = entry
            self.changes.place.append(AdapterPlacement(name=name, pages=list(entry.pages), load_groups=load_groups))
        entry.refs += 1
        self._resident.move_to_end(name)
        return True

    def release(self, name: str) -> None:
        entry = self._resident[name]
        if entry.refs <= 0:
            raise ValueError(f"adapter {name} released more often than acquired")
        entry.refs -= 1
        self._resident.move_to_end(name)  # it was in use until now: most recently used

    def make_room(self, num_pages: int) -> bool:
        """Evict unreferenced adapters (LRU first) until `num_pages` are free."""
        if self._alloc.can_allocate(num_pages):
            return True
        if self._alloc.num_free + self.reclaimable_pages() < num_pages:
            return False
        for name in [n for n, e in self._resident.items() if e.refs == 0]:
            self.drop(name)
            if self._alloc.can_allocate(num_pages):
                return True
        raise OutOfPages(num_pages, self._alloc.num_free)  # unreachable: reclaimable pages were counted

    def drop(self, name: str) -> None:
        """Free an unreferenced adapter's pages now (eviction, or removal by the user)."""
        entry = self._resident.get(name)
        if entry is None:
            return
        if entry.refs:
            raise ValueError(f"adapter {name} is in use by {entry.refs} requests")
        del self._resident[name]
        self._alloc.free(entry.pages)
        # An adapter placed and evicted before any plan carried it needs no message.
        placed_now = [p for p in self.changes.place if p.name == name]
        if placed_now:
            self.changes.place = [p for p in self.changes.place if p.name != name]
        else:
            self.changes.evict.append(name)

    def take_changes(self) -> ResidencyChanges:
        changes, self.changes = self.changes, ResidencyChanges()
        return changes
