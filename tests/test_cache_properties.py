"""Property tests of the adapter cache over the whole API and every policy: the allocator's
page accounting balances, no page has two owners, references never go negative, a
referenced or pinned adapter is never evicted, a stale copy never serves a new request,
prefetch never evicts, and replaying take_changes() on a mirror gives the same residents."""
from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from loraplex.daemon.gpu_cache.policies import POLICY_NAMES, CostWeights
from loraplex.daemon.memory.adapter_residency import AdapterResidency
from loraplex.daemon.memory.allocator import ADAPTER, KV, PageAllocator

NAMES = tuple("abcdef")


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class Mirror:
    """The engine's view: adapter -> (pages, content hash), built only from take_changes()."""

    def __init__(self) -> None:
        self.copies: dict[str, tuple[list[int], str | None]] = {}

    def apply(self, res: AdapterResidency) -> None:
        changes = res.take_changes()
        for name in changes.evict:
            assert name in self.copies, f"evict of {name}, which the engine does not hold"
            del self.copies[name]
        assert set(changes.content_hashes) == {p.name for p in changes.place}
        for p in changes.place:
            assert p.name not in self.copies, f"{p.name} placed twice"
            self.copies[p.name] = (list(p.pages), changes.content_hashes[p.name])
        used = [q for pages, _ in self.copies.values() for q in pages]
        assert len(used) == len(set(used)), "two adapters share a page on the engine"


class CacheMachine(RuleBasedStateMachine):
    @initialize(num_pages=st.integers(1, 30), policy=st.sampled_from(POLICY_NAMES),
                sizes=st.lists(st.integers(0, 8), min_size=len(NAMES), max_size=len(NAMES)))
    def setup(self, num_pages: int, policy: str, sizes: list[int]) -> None:
        self.clock = Clock()
        self.alloc = PageAllocator(num_pages)
        self.res = AdapterResidency(self.alloc, policy, weights=CostWeights(half_life_s=5.0), clock=self.clock)
        self.size = dict(zip(NAMES, sizes))
        self.refs = dict.fromkeys(NAMES, 0)
        self.version = dict.fromkeys(NAMES, 0)
        self.pinned: set[str] = set()
        self.kv: list[list[int]] = []
        self.mirror = Mirror()

    def h(self, name: str) -> str:
        return f"{name}-v{self.version[name]}"

    def protected(self) -> dict[str, list[int]]:
        return {n: self.res.resident_pages(n) for n in self.res.resident_names()
                if self.refs[n] > 0 or n in self.pinned}

    def assert_kept(self, before: dict[str, list[int]], unless: str | None = None) -> None:
        for name, pages in before.items():
            if name != unless:
                assert self.res.resident_pages(name) == pages, f"protected adapter {name} was evicted"

    # ---- rules ----------------------------------------------------------------------------
    @rule(dt=st.floats(0.0, 10.0))
    def tick(self, dt: float) -> None:
        self.clock.t += dt

    @rule(name=st.sampled_from(NAMES), with_hash=st.booleans())
    def acquire(self, name: str, with_hash: bool) -> None:
        before = self.protected()
        ok = self.res.acquire(name, self.size[name], content_hash=self.h(name) if with_hash else None)
        self.assert_kept(before, unless=name if self.refs[name] == 0 else None)
        if not ok:
            return
        self.refs[name] += 1
        assert not self.res.is_stale(name), "a stale copy served a new request"
        assert self.res.content_hash(name) in (None, self.h(name)), "an old copy served a new request"
        assert len(self.res.resident_pages(name)) == self.size[name]

    @rule(name=st.sampled_from(NAMES), backout=st.booleans())
    def release(self, name: str, backout: bool) -> None:
        if self.refs[name] == 0:
            return
        self.res.release(name, backout=backout)
        self.refs[name] -= 1

    @rule(name=st.sampled_from(NAMES))
    def pin(self, name: str) -> None:
        self.res.pin(name)
        self.pinned.add(name)

    @rule(name=st.sampled_from(NAMES))
    def unpin(self, name: str) -> None:
        self.res.unpin(name)
        self.pinned.discard(name)

    @rule(names=st.sets(st.sampled_from(NAMES)))
    def queue(self, names: set[str]) -> None:
        self.res.set_queued(names)

    @rule(policy=st.sampled_from(POLICY_NAMES))
    def switch(self, policy: str) -> None:
        before, resident = self.protected(), set(self.res.resident_names())
        self.res.set_policy(policy)
        assert set(self.res.resident_names()) == resident, "a policy switch keeps the residents"
        self.assert_kept(before)

    @rule(name=st.sampled_from(NAMES))
    def reregister(self, name: str) -> None:
        self.version[name] += 1
        self.res.invalidate(name)
        assert self.res.is_resident(name) == (self.refs[name] > 0)

    @rule(name=st.sampled_from(NAMES))
    def drop(self, name: str) -> None:
        if self.refs[name]:
            return
        self.res.drop(name)
        self.pinned.discard(name)
        assert not self.res.is_resident(name)

    @rule(n=st.integers(1, 12))
    def kv_grow(self, n: int) -> None:
        before = self.protected()
        free, evictable, resident = self.alloc.num_free, self.res.reclaimable_pages(), self.res.resident_names()
        ok = self.res.make_room(n)
        assert ok == (free + evictable >= n)
        if not ok:
            assert self.res.resident_names() == resident, "a failed make_room evicts nothing"
        self.assert_kept(before)
        if ok:
            self.kv.append(self.alloc.allocate(n, KV))

    @precondition(lambda self: bool(self.kv))
    @rule(i=st.integers(0, 100))
    def kv_free(self, i: int) -> None:
        self.alloc.free(self.kv.pop(i % len(self.kv)))

    @rule(candidates=st.lists(st.sampled_from(NAMES), max_size=6), budget=st.integers(0, 20))
    def prefetch(self, candidates: list[str], budget: int) -> None:
        resident, free = set(self.res.resident_names()), self.alloc.num_free
        placed = self.res.prefetch(candidates, self.size.__getitem__, budget, hash_of=self.h)
        assert resident <= set(self.res.resident_names()), "prefetch evicted something"
        assert sum(len(p.pages) for p in placed) <= min(free, budget)
        for p in placed:
            assert p.name not in resident and (p.name in candidates or p.name in self.pinned)

    @rule()
    def send_plan(self) -> None:
        self.mirror.apply(self.res)
        assert sorted(self.mirror.copies) == sorted(self.res.resident_names())
        for name, (pages, content_hash) in self.mirror.copies.items():
            assert pages == self.res.resident_pages(name)
            assert content_hash == self.res.content_hash(name)

    # ---- invariants -------------------------------------------------------------------------
    @invariant()
    def pages_balance(self) -> None:
        adapter_pages = [p for n in self.res.resident_names() for p in self.res.resident_pages(n)]
        kv_pages = [p for pages in self.kv for p in pages]
        owned = adapter_pages + kv_pages
        assert len(owned) == len(set(owned)), "a page has two owners"
        usage = self.alloc.usage()
        assert usage.by_tag.get(ADAPTER, 0) == len(adapter_pages)
        assert usage.by_tag.get(KV, 0) == len(kv_pages)
        assert usage.free + len(owned) == usage.total

    @invariant()
    def references(self) -> None:
        for name in NAMES:
            assert self.refs[name] >= 0
            assert self.res.refs(name) == self.refs[name]
            if self.refs[name]:
                assert self.res.is_resident(name), "a referenced adapter was evicted"
            assert self.res.is_pinned(name) == (name in self.pinned)
        assert self.res.reclaimable_pages() == sum(
            self.size[n] for n in self.res.resident_names() if self.refs[n] == 0 and n not in self.pinned)
        totals = self.res.totals
        assert min(totals.hits, totals.misses, totals.loads, totals.prefetches, totals.prefetch_hits) >= 0


CacheMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=50, deadline=None)
TestCacheProperties = CacheMachine.TestCase
