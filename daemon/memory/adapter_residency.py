"""Which adapters hold pages in the unified pool, who uses them, and which leave first.

Torch-free GPU adapter cache (docs/architecture.md, 'The unified pool'; Chameleon §4.1). An adapter is placed on
first use and reference-counted by the sequences running with it; at zero
references it stays resident in otherwise idle pages until the allocator needs
them. Then unreferenced, unpinned adapters leave in the policy's order, those no
queued request needs before those one does. It never evicts a referenced or
pinned adapter, never allocates KV pages, and never serves a stale copy.
"""
from __future__ import annotations

import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Literal

from loraplex.daemon.gpu_cache.counters import AdapterUsage, CacheTotals
from loraplex.daemon.gpu_cache.policies import CostWeights, EvictionPolicy, make_policy
from loraplex.daemon.gpu_cache.predictor import ArrivalPredictor
from loraplex.daemon.memory.allocator import ADAPTER, OutOfPages, PageAllocator
from loraplex.daemon.memory.prefix_cache import PrefixCache
from loraplex.ipc.engine_plan import AdapterPlacement

_Access = Literal["hit", "prefetch_hit", "miss"]
_Reason = Literal["evict", "invalidate", "drop"]


@dataclass(slots=True)
class ResidentAdapter:
    """One resident copy: the pages it holds and the content it was placed with."""

    name: str
    pages: list[int]
    usage: AdapterUsage
    placed_tick: int
    content_hash: str | None = None
    refs: int = 0
    stale: bool = False  # its content was replaced while referenced: no new users; freed at zero refs
    prefetched: bool = False  # placed ahead of use and not acquired since
    by_prefetch: bool = False  # this copy was placed by prefetch()
    # Placed for a request that has not acquired it yet (its acquire was backed out, or it was
    # placed ahead while the request waits): that request's acquire is the miss.
    owed_miss: bool = False
    # How each current reference was counted, oldest first: a backout undoes the newest (it
    # follows its own acquire), a normal release retires the oldest; the length is `refs`.
    accesses: deque[_Access] = field(default_factory=deque)

    @property
    def num_pages(self) -> int:
        return len(self.pages)

    @property
    def last_used(self) -> float:
        return self.usage.last_used

    def frequency(self, now: float) -> float:
        return self.usage.frequency(now)


@dataclass(slots=True)
class ResidencyChanges:
    """Placements and evictions to send to the engine with the next plan, in order:
    evictions first, so freed pages can be reused by placements of the same step.
    content_hashes: the content hash each placement in `place` was made for."""

    place: list[AdapterPlacement] = field(default_factory=list)
    evict: list[str] = field(default_factory=list)
    content_hashes: dict[str, str | None] = field(default_factory=dict)


class AdapterResidency:
    """The GPU adapter cache over the daemon's page allocator.

    policy: "none" | "lru" | "fifo" | "cost" (see loraplex.daemon.gpu_cache.policies);
    weights: cost-policy weights and frequency half-life; predictor: extends
    prefetch candidates with adapters expected soon (None: off); host_resident: whether
    an adapter sits in the host store (None: all do), so predictor picks still on disk
    are not prefetched; clock: seconds. prefix: the prefix cache sharing the pool (None:
    off): its idle pages and idle adapters leave in one order when room is needed, and an
    adapter whose content changes (invalidate) or that is removed (forget) takes its cached
    prefixes with it.
    """

    def __init__(self, allocator: PageAllocator, policy: str = "lru", *, weights: CostWeights | None = None,
                 predictor: ArrivalPredictor | None = None, host_resident: Callable[[str], bool] | None = None,
                 clock: Callable[[], float] = time.monotonic, prefix: PrefixCache | None = None) -> None:
        self._alloc = allocator
        self._prefix = prefix
        self._weights = weights or CostWeights()
        self._policy: EvictionPolicy = make_policy(policy, self._weights)
        self._predictor = predictor
        self.host_resident = host_resident
        self._clock = clock
        self._resident: OrderedDict[str, ResidentAdapter] = OrderedDict()  # least recently used first
        self._usage: dict[str, AdapterUsage] = {}
        self._pinned: dict[str, None] = {}  # insertion-ordered set
        self._queued: frozenset[str] = frozenset()
        self._arriving: frozenset[str] = frozenset()  # placed, layer groups still on their way
        self._tick = 0
        self.totals = CacheTotals()
        self.changes = ResidencyChanges()

    # ---- queries ------------------------------------------------------------------------
    @property
    def policy_name(self) -> str:
        return self._policy.name

    @property
    def weights(self) -> CostWeights:
        return self._weights

    def is_resident(self, name: str) -> bool:
        return name in self._resident

    def refs(self, name: str) -> int:
        entry = self._resident.get(name)
        return 0 if entry is None else entry.refs

    def resident_names(self) -> list[str]:
        """Resident adapters, least recently used first (whatever the policy)."""
        return list(self._resident)

    def resident_pages(self, name: str) -> list[int]:
        entry = self._resident.get(name)
        return [] if entry is None else list(entry.pages)

    def content_hash(self, name: str) -> str | None:
        """Content hash the resident copy of `name` was placed with (None: not resident or unhashed)."""
        entry = self._resident.get(name)
        return None if entry is None else entry.content_hash

    def is_ready(self, name: str) -> bool:
        """Resident, current, and fully on the GPU: its placement has gone out with a plan and
        the engine no longer reports it arriving."""
        entry = self._resident.get(name)
        return (entry is not None and not entry.stale and name not in self._arriving
                and not self._placement_pending(name))

    def is_stale(self, name: str) -> bool:
        entry = self._resident.get(name)
        return entry is not None and entry.stale

    def is_pinned(self, name: str) -> bool:
        return name in self._pinned

    def pinned_names(self) -> list[str]:
        return list(self._pinned)

    def queued_names(self) -> frozenset[str]:
        return self._queued

    def usage(self, name: str) -> AdapterUsage | None:
        return self._usage.get(name)

    def reclaimable_pages(self) -> int:
        """Pages make_room could free: idle adapters' and idle cached prefixes'."""
        idle_prefix = 0 if self._prefix is None else self._prefix.idle_pages
        return idle_prefix + sum(e.num_pages for e in self._resident.values() if self._evictable(e))

    def eviction_order(self) -> list[str]:
        """Names make_room would evict, first victim first."""
        return [e.name for e in self._victims()]

    # ---- configuration --------------------------------------------------------------------
    def set_policy(self, name: str, weights: CostWeights | None = None) -> None:
        """Switch eviction policy at run time; residents, references and history stay."""
        policy = make_policy(name, weights or self._weights)  # raises on an unknown name, changing nothing
        if weights is not None and weights.half_life_s != self._weights.half_life_s:
            now = self._clock()
            for usage in self._usage.values():
                usage.set_half_life(weights.half_life_s, now)
        self._weights = weights or self._weights
        self._policy = policy

    def set_queued(self, names: Iterable[str | None]) -> None:
        """Adapters the waiting requests need; kept over other unreferenced ones under pressure."""
        self._queued = frozenset(n for n in names if n is not None)

    def set_arriving(self, names: Iterable[str]) -> None:
        """Adapters whose loads the engine reported still in progress after its last step
        (kept over eviction, and awaited by admit_when_loaded)."""
        self._arriving = frozenset(names)

    @property
    def arriving(self) -> frozenset[str]:
        return self._arriving

    def pin(self, name: str) -> None:
        """Never evict `name`; if it is not resident, prefetch() places it when free pages allow."""
        self._pinned[name] = None

    def unpin(self, name: str) -> None:
        self._pinned.pop(name, None)
        entry = self._resident.get(name)
        if entry is not None and entry.refs == 0 and self._policy.free_on_release:
            self._free(entry, "evict")

    # ---- use --------------------------------------------------------------------------------
    def acquire(self, name: str, num_pages: int, load_groups: int = 1, content_hash: str | None = None) -> bool:
        """Reference `name`, placing it if needed; False when the pages cannot be found, or
        while an old copy (stale, or another `content_hash`) is still referenced.
        content_hash None accepts whatever non-stale copy is resident."""
        entry = self._resident.get(name)
        if entry is not None and (entry.stale or (content_hash is not None and content_hash != entry.content_hash)):
            if entry.refs:
                entry.stale = True
                return False
            self._free(entry, "invalidate")
            entry = None
        if entry is None:
            if not self.make_room(num_pages):
                return False
            entry = self._place(name, num_pages, load_groups, content_hash, prefetched=False)
            access: _Access = "miss"
        elif entry.owed_miss:
            access = "miss"
        else:
            access = "prefetch_hit" if entry.prefetched else "hit"
        self._count(entry, access, +1)
        entry.owed_miss = entry.prefetched = False
        entry.accesses.append(access)
        entry.refs += 1
        entry.usage.accessed(self._clock())
        self._resident.move_to_end(name)
        return True

    def place_ahead(self, name: str, num_pages: int, load_groups: int = 1) -> bool:
        """Start bringing `name` to the GPU for a queued request that waits for it (evicting in
        policy order if needed) without referencing it; the request's acquire counts the miss.
        True when it is resident or now being placed."""
        entry = self._resident.get(name)
        if entry is not None:  # placed (e.g. prefetched) but still arriving: the wait makes it a miss
            entry.owed_miss = not entry.stale
            return not entry.stale
        if not self.make_room(num_pages):
            return False
        self._place(name, num_pages, load_groups, None, prefetched=False).owed_miss = True
        return True

    def release(self, name: str, *, backout: bool = False) -> None:
        """Drop one reference. backout=True: the newest acquire is undone (its request was not
        admitted after all), so it is not counted as a hit or miss."""
        entry = self._resident[name]
        if entry.refs <= 0:
            raise ValueError(f"adapter {name} released more often than acquired")
        entry.refs -= 1
        if backout:
            access = entry.accesses.pop()
            self._count(entry, access, -1)
            entry.usage.undo_access()
            entry.owed_miss = access == "miss"
            entry.prefetched = access == "prefetch_hit"
        else:
            entry.accesses.popleft()
            entry.usage.last_used = self._clock()
            self._resident.move_to_end(name)  # it was in use until now: most recently used
        if entry.refs == 0:
            if entry.stale:
                self._free(entry, "invalidate")
            elif self._policy.free_on_release and name not in self._pinned and not (backout and name in self._queued):
                # A backout is not a use: the request it was placed for still queues for it.
                self._free(entry, "evict")

    def make_room(self, num_pages: int) -> bool:
        """Free pages until `num_pages` are free: unreferenced, unpinned adapters in policy order
        (those no queued request needs first) and idle cached prefix pages, one order for both:
        a prefix page used longer ago than the next adapter victim goes first, and adapters
        queued requests need go last (with separate budgets, every idle adapter goes before any
        prefix page). False, evicting nothing, when that cannot be done."""
        if self._alloc.can_allocate(num_pages):
            return True
        victims = self._victims()
        if self._alloc.num_free + self.reclaimable_pages() < num_pages:
            return False
        prefix = self._prefix
        while not self._alloc.can_allocate(num_pages):
            oldest_prefix = None if prefix is None else prefix.oldest_idle()
            victim = victims[0] if victims else None
            if oldest_prefix is not None and (victim is None or (prefix.unified and (
                    victim.name in self._queued or oldest_prefix <= victim.last_used))):
                prefix.evict(1)
                continue
            if victim is None:
                raise OutOfPages(num_pages, self._alloc.num_free)  # unreachable: reclaimable pages were counted
            victims.pop(0)
            self._free(victim, "evict")
        return True

    def drop(self, name: str) -> None:
        """Free an unreferenced adapter's pages now and forget its pin (removal by the user)."""
        entry = self._resident.get(name)
        if entry is not None and entry.refs:
            raise ValueError(f"adapter {name} is in use by {entry.refs} requests")
        self._pinned.pop(name, None)
        if entry is not None:
            self._free(entry, "drop")

    def forget(self, name: str) -> None:
        """drop(), and also forget the adapter's counters, arrival history and cached prefixes
        (adapter removed). A drop alone (host-tier eviction) keeps its prefixes: the content
        they were computed with is unchanged."""
        self.drop(name)
        if self._prefix is not None:
            self._prefix.forget_adapter(name)
        self._usage.pop(name, None)
        if self._predictor is not None:
            self._predictor.forget(name)

    def invalidate(self, name: str) -> None:
        """The content behind `name` changed: free the resident copy now if unreferenced, else
        mark it stale (no new users; freed when its last reference goes). Its cached prefixes
        are never matched again."""
        if self._prefix is not None:
            self._prefix.forget_adapter(name)
        entry = self._resident.get(name)
        if entry is None:
            return
        if entry.refs:
            entry.stale = True
        else:
            self._free(entry, "invalidate")

    # ---- prefetch and reports ----------------------------------------------------------------
    def note_arrival(self, name: str) -> None:
        """A request for `name` arrived (feeds the predictor when one is configured)."""
        if self._predictor is not None:
            self._predictor.record(name, self._clock())

    def prefetch(self, candidates: Iterable[str], pages_of: Callable[[str], int], budget_pages: int, *,
                 load_groups: int = 1, hash_of: Callable[[str], str | None] | None = None) -> list[AdapterPlacement]:
        """Place adapters that are not resident into FREE pages only (nothing is evicted), at most
        `budget_pages` in all: pinned ones first, then `candidates` in order (the adapters of
        queued requests, queue order), then the predictor's picks that are host-resident. Returns
        the placements made; they also go out with the next take_changes()."""
        order: list[str] = [*self._pinned, *candidates]
        if self._predictor is not None:
            # A guess still on disk would first need a disk read into the host store: not worth
            # it ahead of a request (queued requests' adapters are brought to the host anyway).
            on_host = self.host_resident
            order += [n for n in self._predictor.predict(self._clock()) if on_host is None or on_host(n)]
        placed: list[AdapterPlacement] = []
        seen: set[str] = set()
        for name in order:
            if name in seen or name in self._resident:
                continue
            seen.add(name)
            n = pages_of(name)
            if n > budget_pages or not self._alloc.can_allocate(n):
                continue
            self._place(name, n, load_groups, hash_of(name) if hash_of else None, prefetched=True)
            placed.append(self.changes.place[-1])
            budget_pages -= n
        return placed

    def record_load_ms(self, name: str, ms: float) -> None:
        """The engine reports how long placing `name` took."""
        if not ms >= 0:
            raise ValueError(f"load time must be non-negative, got {ms}")
        usage = self._usage_of(name)
        usage.load_ms += ms
        usage.load_reports += 1
        self.totals.load_ms += ms
        self.totals.load_reports += 1

    def take_changes(self) -> ResidencyChanges:
        changes, self.changes = self.changes, ResidencyChanges()
        return changes

    def snapshot(self, *, rank_of: Callable[[str], int | None] | None = None, limit: int = 64) -> dict[str, object]:
        """The `cache` map for stats: totals, hit rate, evictions/s and up to `limit` resident
        adapters, those kept longest first (the next victim is last)."""
        now = self._clock()
        entries = list(self._resident.values())
        scores = self._policy.scores(entries, now) or {}
        victims = self._victims()
        rank = {e.name: i for i, e in enumerate(victims)}
        kept = sorted(entries, key=lambda e: (e.name in rank, -rank.get(e.name, 0), -e.usage.last_used))
        rows = []
        for e in kept[:limit]:
            u = e.usage
            row: dict[str, object] = {
                "name": e.name, "pages": e.num_pages, "refs": e.refs, "hits": u.hits, "misses": u.misses,
                "loads": u.loads, "evictions": u.evictions, "score": scores.get(e.name),
                "pinned": e.name in self._pinned, "queued": e.name in self._queued, "stale": e.stale,
                "content_hash": e.content_hash, "load_ms_mean": u.load_ms_mean(),
            }
            if rank_of is not None:
                row["rank"] = rank_of(e.name)
            rows.append(row)
        return {
            "policy": self._policy.name, **self.totals.as_dict(now),
            "resident": len(entries), "resident_pages": sum(e.num_pages for e in entries),
            "reclaimable_pages": self.reclaimable_pages(), "pinned": len(self._pinned),
            "queued": len(self._queued), "adapters": rows,
        }

    # ---- internals -----------------------------------------------------------------------------
    def _usage_of(self, name: str) -> AdapterUsage:
        usage = self._usage.get(name)
        if usage is None:
            usage = self._usage[name] = AdapterUsage(name=name, half_life_s=self._weights.half_life_s)
        return usage

    def _placement_pending(self, name: str) -> bool:
        """Placed since the last take_changes(): no plan has carried it to the engine yet."""
        return any(p.name == name for p in self.changes.place)

    def _evictable(self, entry: ResidentAdapter) -> bool:
        # An adapter still arriving is not evicted: its copy cannot be called back (the link
        # carries it anyway), and the engine would hold the step until it lands before the
        # pages could be reused.
        return entry.refs == 0 and entry.name not in self._pinned and entry.name not in self._arriving

    def _victims(self) -> list[ResidentAdapter]:
        ordered = self._policy.order(list(self._resident.values()), self._clock())
        cold = [e for e in ordered if self._evictable(e) and e.name not in self._queued]
        warm = [e for e in ordered if self._evictable(e) and e.name in self._queued]
        return cold + warm

    def _place(self, name: str, num_pages: int, load_groups: int, content_hash: str | None, *,
               prefetched: bool) -> ResidentAdapter:
        usage = self._usage_of(name)
        self._tick += 1
        entry = ResidentAdapter(name=name, pages=self._alloc.allocate(num_pages, ADAPTER), usage=usage,
                                placed_tick=self._tick, content_hash=content_hash, prefetched=prefetched,
                                by_prefetch=prefetched)
        usage.last_used = self._clock()
        self._resident[name] = entry
        self.changes.place.append(AdapterPlacement(name=name, pages=list(entry.pages), load_groups=load_groups))
        self.changes.content_hashes[name] = content_hash
        self._count_load(entry, +1)
        return entry

    def _free(self, entry: ResidentAdapter, reason: _Reason) -> None:
        name = entry.name
        del self._resident[name]
        self._alloc.free(entry.pages)
        if self._placement_pending(name):
            # Placed and freed before any plan carried it: no message, and no load happened.
            self.changes.place = [p for p in self.changes.place if p.name != name]
            self.changes.content_hashes.pop(name, None)
            self._count_load(entry, -1)
            return
        self.changes.evict.append(name)
        if reason == "evict":
            entry.usage.evictions += 1
            self.totals.evictions += 1
            self.totals.eviction_times.append(self._clock())
        elif reason == "invalidate":
            entry.usage.invalidations += 1
            self.totals.invalidations += 1

    def _count_load(self, entry: ResidentAdapter, sign: int) -> None:
        entry.usage.loads += sign
        self.totals.loads += sign
        if entry.by_prefetch:
            entry.usage.prefetches += sign
            self.totals.prefetches += sign

    def _count(self, entry: ResidentAdapter, access: _Access, sign: int) -> None:
        u, t = entry.usage, self.totals
        if access == "miss":
            u.misses += sign
            t.misses += sign
            return
        u.hits += sign
        t.hits += sign
        if access == "prefetch_hit":
            u.prefetch_hits += sign
            t.prefetch_hits += sign
