"""Adapter residency under the default policy (lru): referenced adapters stay put,
unreferenced ones leave in LRU order, and the change list keeps an engine-side mirror
of the pool exact. Other policies, pins, queues and content identity:
tests/test_cache_*.py."""
from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from loraplex.daemon.memory.adapter_residency import AdapterResidency
from loraplex.daemon.memory.allocator import ADAPTER, KV, PageAllocator

NAMES = tuple("abcdefgh")


class EngineMirror:
    """What the engine knows: adapter -> pages, updated only from take_changes()."""

    def __init__(self) -> None:
        self.pages: dict[str, list[int]] = {}

    def apply(self, residency: AdapterResidency) -> None:
        changes = residency.take_changes()
        for name in changes.evict:  # evictions first: their pages may be reused below
            assert name in self.pages, f"evict of {name} that the engine never placed"
            del self.pages[name]
        for placement in changes.place:
            assert placement.name not in self.pages, f"{placement.name} placed twice"
            self.pages[placement.name] = list(placement.pages)
        used = [p for pages in self.pages.values() for p in pages]
        assert len(used) == len(set(used)), "two adapters share a page on the engine"


class ResidencyMachine(RuleBasedStateMachine):
    @initialize(num_pages=st.integers(1, 24), sizes=st.lists(st.integers(0, 8), min_size=len(NAMES),
                                                             max_size=len(NAMES)))
    def setup(self, num_pages: int, sizes: list[int]) -> None:
        self.alloc = PageAllocator(num_pages)
        self.res = AdapterResidency(self.alloc)
        self.size = dict(zip(NAMES, sizes))
        self.refs = {n: 0 for n in NAMES}
        self.lru: list[str] = []  # model of residency, least recently used first
        self.kv: list[list[int]] = []
        self.engine = EngineMirror()

    def _touch(self, name: str) -> None:
        if name in self.lru:
            self.lru.remove(name)
        self.lru.append(name)

    def _expected_victims(self, need: int) -> list[str] | None:
        free = self.alloc.num_free
        if need <= free:
            return []
        victims = []
        for name in self.lru:
            if self.refs[name] == 0 and free < need:
                victims.append(name)
                free += self.size[name]
        return victims if free >= need else None

    @rule(name=st.sampled_from(NAMES))
    def acquire(self, name: str) -> None:
        before = list(self.res.resident_names())
        victims = [] if name in self.lru else self._expected_victims(self.size[name])
        ok = self.res.acquire(name, self.size[name])
        assert ok == (victims is not None)
        if not ok:
            assert self.res.resident_names() == before, "a failed acquire must evict nothing"
            return
        for v in victims:
            self.lru.remove(v)
        self.refs[name] += 1
        self._touch(name)

    @rule(name=st.sampled_from(NAMES))
    def release(self, name: str) -> None:
        if self.refs[name] == 0:
            with pytest.raises((ValueError, KeyError)):
                self.res.release(name)
            return
        self.res.release(name)
        self.refs[name] -= 1
        self._touch(name)

    @rule(name=st.sampled_from(NAMES))
    def backout(self, name: str) -> None:
        """An admission undone: the reference goes, recency stays as the acquire left it."""
        if self.refs[name] == 0:
            return
        self.res.release(name, backout=True)
        self.refs[name] -= 1

    @rule(name=st.sampled_from(NAMES))
    def drop(self, name: str) -> None:
        if self.refs[name]:
            with pytest.raises(ValueError, match="in use"):
                self.res.drop(name)
            return
        self.res.drop(name)
        if name in self.lru:
            self.lru.remove(name)

    @rule(n=st.integers(1, 10))
    def kv_allocation(self, n: int) -> None:
        victims = self._expected_victims(n)
        assert self.res.make_room(n) == (victims is not None)
        if victims is None:
            return
        for v in victims:
            self.lru.remove(v)
        self.kv.append(self.alloc.allocate(n, KV))

    @rule()
    def kv_free(self) -> None:
        if self.kv:
            self.alloc.free(self.kv.pop(0))

    @rule()
    def send_plan(self) -> None:
        self.engine.apply(self.res)
        assert sorted(self.engine.pages) == sorted(self.res.resident_names())
        assert all(len(pages) == self.size[n] for n, pages in self.engine.pages.items())
        for pages in self.kv:
            assert not set(pages) & {p for ps in self.engine.pages.values() for p in ps}

    @invariant()
    def consistent(self) -> None:
        assert self.res.resident_names() == self.lru, "eviction or recency order differs from LRU"
        for name in NAMES:
            assert self.res.refs(name) == self.refs[name]
            if self.refs[name]:
                assert self.res.is_resident(name), "a referenced adapter was evicted"
        held = sum(self.size[n] for n in self.lru)
        assert self.alloc.usage().by_tag.get(ADAPTER, 0) == held
        assert self.res.reclaimable_pages() == sum(self.size[n] for n in self.lru if self.refs[n] == 0)


ResidencyMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
TestResidencyStateful = ResidencyMachine.TestCase


def test_default_policy_is_lru() -> None:
    assert AdapterResidency(PageAllocator(4)).policy_name == "lru"


def make(num_pages: int) -> tuple[PageAllocator, AdapterResidency]:
    alloc = PageAllocator(num_pages)
    return alloc, AdapterResidency(alloc)


def use(res: AdapterResidency, name: str, pages: int) -> None:
    assert res.acquire(name, pages)
    res.release(name)


def test_unreferenced_adapters_leave_least_recently_used_first() -> None:
    alloc, res = make(10)
    for name in "abc":
        use(res, name, 3)
    assert alloc.num_free == 1
    assert res.make_room(3)
    assert res.resident_names() == ["b", "c"]
    assert res.make_room(6)
    assert res.resident_names() == ["c"]
    assert res.take_changes().evict == []  # all placed and gone before any plan carried them


def test_reuse_refreshes_recency() -> None:
    alloc, res = make(9)
    for name in "abc":
        use(res, name, 3)
    use(res, "a", 3)  # a is resident already: no new pages, now the most recent
    assert alloc.num_free == 0
    assert res.make_room(3)
    assert res.resident_names() == ["c", "a"]


def test_recency_counts_until_release() -> None:
    # a was acquired first but stayed in use longer: b is the least recently used.
    _, res = make(6)
    assert res.acquire("a", 3)
    assert res.acquire("b", 3)
    res.release("b")
    res.release("a")
    assert res.make_room(3)
    assert res.resident_names() == ["a"]


def test_referenced_adapters_are_never_evicted() -> None:
    alloc, res = make(10)
    assert res.acquire("busy", 4)
    use(res, "idle", 4)
    assert not res.make_room(7), "only 2 free + 4 reclaimable pages exist"
    assert res.resident_names() == ["busy", "idle"], "a failed make_room must not evict anything"
    assert not res.acquire("big", 7)
    assert res.make_room(6)
    assert res.resident_names() == ["busy"]
    with pytest.raises(ValueError, match="in use"):
        res.drop("busy")
    assert res.is_resident("busy") and alloc.usage().by_tag == {ADAPTER: 4}


def test_adapters_still_arriving_are_not_evicted_until_reported_in() -> None:
    _, res = make(10)
    use(res, "old", 4)
    assert res.place_ahead("new", 4)
    res.take_changes()  # a plan carried the placement; the engine reports it still arriving
    res.set_arriving(["new"])
    assert res.eviction_order() == ["old"] and res.reclaimable_pages() == 4
    assert not res.make_room(8), "2 free + old's 4: new's copy cannot be called back"
    assert res.resident_names() == ["old", "new"]
    res.set_arriving([])
    assert res.make_room(8) and res.resident_names() == []


def test_placed_ahead_counts_its_miss_at_the_acquire() -> None:
    _, res = make(10)
    assert res.place_ahead("x", 3) and res.place_ahead("x", 3)  # the second finds it placed
    assert not res.is_ready("x"), "no plan has carried the placement yet"
    assert [p.name for p in res.take_changes().place] == ["x"]
    res.set_arriving(["x"])
    assert not res.is_ready("x")
    res.set_arriving([])
    assert res.is_ready("x")
    assert res.acquire("x", 3)
    assert (res.totals.misses, res.totals.hits, res.totals.loads) == (1, 0, 1)


def test_backouts_undo_the_newest_acquires_first() -> None:
    _, res = make(10)
    assert res.acquire("a", 2) and res.acquire("a", 2)  # a miss, then a hit
    res.release("a", backout=True)
    assert (res.totals.hits, res.totals.misses) == (0, 1)
    res.release("a", backout=True)
    assert (res.totals.hits, res.totals.misses) == (0, 0)
    assert res.acquire("a", 2)  # the placement is still owed its miss
    assert (res.totals.hits, res.totals.misses) == (0, 1)


def test_none_keeps_an_adapter_backed_out_for_a_request_still_queued() -> None:
    """Under `none` the last release frees, but a backout is not a use: the request it was
    placed for still waits for it, so freeing would only load it again."""
    alloc = PageAllocator(10)
    res = AdapterResidency(alloc, "none")
    res.set_queued(["x"])
    assert res.acquire("x", 3)
    res.release("x", backout=True)
    assert res.is_resident("x") and res.eviction_order() == ["x"]
    res.set_queued([])
    assert res.acquire("x", 3)  # its request is admitted after all: the owed miss
    assert (res.totals.hits, res.totals.misses, res.totals.loads) == (0, 1, 1)
    res.release("x", backout=True)  # no longer queued: freed at once
    assert not res.is_resident("x") and alloc.num_free == 10


def test_placed_then_dropped_before_a_plan_sends_nothing() -> None:
    alloc, res = make(8)
    use(res, "x", 2)
    res.drop("x")
    changes = res.take_changes()
    assert changes.place == [] and changes.evict == []
    assert alloc.num_free == 8


def test_evict_after_a_plan_carried_the_placement() -> None:
    _, res = make(8)
    assert res.acquire("x", 2)
    first = res.take_changes()
    assert [(p.name, len(p.pages)) for p in first.place] == [("x", 2)] and first.evict == []
    res.release("x")
    res.drop("x")
    assert res.acquire("x", 3)  # back again before the next plan: evict the old copy, place the new
    changes = res.take_changes()
    assert changes.evict == ["x"]
    assert [(p.name, len(p.pages)) for p in changes.place] == [("x", 3)]
    assert res.take_changes().evict == [] and res.take_changes().place == []


def test_placement_lists_the_allocated_pages() -> None:
    alloc, res = make(8)
    alloc.allocate(3, KV)
    assert res.acquire("x", 4)
    (placement,) = res.take_changes().place
    assert len(placement.pages) == len(set(placement.pages)) == 4
    assert alloc.usage().by_tag == {KV: 3, ADAPTER: 4}
    alloc.free(alloc.allocate(1, KV))
    assert res.acquire("x", 4) and res.take_changes().place == []  # resident: no second placement


def test_release_below_zero_raises() -> None:
    _, res = make(4)
    assert res.acquire("x", 1)
    res.release("x")
    with pytest.raises(ValueError, match="released more often"):
        res.release("x")
    assert res.refs("x") == 0 and res.is_resident("x")
    with pytest.raises(KeyError):
        res.release("never-seen")


def test_drop_of_unknown_adapter_is_a_no_op() -> None:
    alloc, res = make(4)
    res.drop("nothing")
    assert res.take_changes().evict == [] and alloc.num_free == 4
