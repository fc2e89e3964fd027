"""Cache residency beyond eviction order: pinning, run-time policy switch, content
identity (invalidate / stale copies), prefetch into free pages only, counters and the
stats snapshot."""
from __future__ import annotations

import pytest

from loraplex.daemon.gpu_cache.policies import CostWeights
from loraplex.daemon.gpu_cache.predictor import ArrivalPredictor, PredictorConfig
from loraplex.daemon.memory.adapter_residency import AdapterResidency
from loraplex.daemon.memory.allocator import KV, PageAllocator

SIZES = {"a": 3, "b": 3, "c": 3, "d": 2, "e": 4}


class Clock:
    def __init__(self) -> None:
        self.t = 50.0

    def __call__(self) -> float:
        return self.t


def make(num_pages: int, policy: str = "lru", **kw: object) -> tuple[PageAllocator, AdapterResidency, Clock]:
    alloc, clock = PageAllocator(num_pages), Clock()
    return alloc, AdapterResidency(alloc, policy, clock=clock, **kw), clock  # type: ignore[arg-type]


def use(res: AdapterResidency, name: str, content_hash: str | None = None) -> None:
    assert res.acquire(name, SIZES[name], content_hash=content_hash)
    res.release(name)


# ---- pinning -----------------------------------------------------------------------------------
@pytest.mark.parametrize("policy", ["none", "lru", "fifo", "cost"])
def test_pinned_adapters_are_never_evicted(policy: str) -> None:
    alloc, res, _ = make(9, policy)
    res.pin("a")
    use(res, "a")
    assert res.is_resident("a"), "a pinned adapter outlives its last reference, even under none"
    for name in "bc":
        assert res.acquire(name, 3)
    for name in "bc":
        res.release(name)
    assert not res.make_room(9), "only b and c may go"
    assert res.make_room(6) and res.resident_names() == ["a"]
    assert "a" not in res.eviction_order() and res.reclaimable_pages() == 0
    res.unpin("a")
    assert res.is_resident("a") == (policy != "none"), "unpinned: free on last use applies at once under none"
    assert res.make_room(9) and not res.is_resident("a") and alloc.num_free == 9


def test_a_pinned_adapter_that_is_not_resident_is_placed_by_prefetch() -> None:
    alloc, res, _ = make(6, "lru")
    kv = alloc.allocate(5, KV)
    res.pin("a")
    assert res.prefetch([], SIZES.__getitem__, budget_pages=100) == [], "no free pages yet"
    alloc.free(kv)
    placed = res.prefetch(["b"], SIZES.__getitem__, budget_pages=100)
    assert [p.name for p in placed] == ["a", "b"], "pinned adapters come first"
    assert not res.make_room(6), "the pinned pages cannot be reclaimed"
    assert res.make_room(3) and res.resident_names() == ["a"]


def test_drop_forgets_the_pin() -> None:
    _, res, _ = make(9)
    res.pin("a")
    use(res, "a")
    res.drop("a")
    assert not res.is_pinned("a") and not res.is_resident("a")
    assert res.prefetch([], SIZES.__getitem__, budget_pages=9) == []


# ---- policy switch -----------------------------------------------------------------------------
def test_switching_policy_keeps_residents_and_references() -> None:
    _, res, clock = make(12, "lru")
    for name in "abc":
        clock.t += 1
        use(res, name)
    assert res.acquire("d", 2)
    clock.t += 1
    use(res, "a")
    assert res.eviction_order() == ["b", "c", "a"]
    res.set_policy("fifo")
    assert res.policy_name == "fifo" and res.eviction_order() == ["a", "b", "c"]
    res.set_policy("cost", CostWeights(frequency=1.0, recency=0.0, size=0.0))
    assert res.eviction_order()[-1] == "a", "a was used twice"
    assert res.weights.frequency == 1.0
    res.set_policy("none")
    assert sorted(res.resident_names()) == ["a", "b", "c", "d"], "a switch keeps the residents"
    assert res.refs("d") == 1
    res.release("d")
    assert not res.is_resident("d"), "under none the last release frees"
    assert res.eviction_order() == ["b", "c", "a"], "leftovers leave least recently used first"
    with pytest.raises(ValueError):
        res.set_policy("mru", CostWeights(half_life_s=1.0))
    assert res.policy_name == "none" and res.weights.half_life_s == 60.0, "a refused switch changes nothing"


# ---- content identity ------------------------------------------------------------------------
def test_invalidate_frees_an_unreferenced_copy_at_once() -> None:
    alloc, res, _ = make(9)
    use(res, "a", "h1")
    res.take_changes()
    res.invalidate("a")
    assert not res.is_resident("a") and alloc.num_free == 9
    assert res.take_changes().evict == ["a"] and res.totals.invalidations == 1
    assert res.acquire("a", 3, content_hash="h2")
    changes = res.take_changes()
    assert [p.name for p in changes.place] == ["a"] and changes.content_hashes == {"a": "h2"}
    assert res.content_hash("a") == "h2"
    res.invalidate("never-placed")  # no-op


def test_a_referenced_stale_copy_serves_no_new_request() -> None:
    _, res, _ = make(9)
    assert res.acquire("a", 3, content_hash="h1")
    res.take_changes()
    res.invalidate("a")
    assert res.is_stale("a") and res.refs("a") == 1
    assert not res.acquire("a", 3, content_hash="h2"), "never hand the old copy to a new request"
    assert not res.acquire("a", 3), "not even when the caller gives no hash"
    assert res.refs("a") == 1
    res.release("a")
    assert not res.is_resident("a"), "freed when the last old user leaves"
    assert res.take_changes().evict == ["a"]
    assert res.acquire("a", 3, content_hash="h2") and res.content_hash("a") == "h2"
    changes = res.take_changes()
    assert changes.evict == [] and changes.content_hashes == {"a": "h2"}


def test_a_new_hash_in_acquire_replaces_the_copy() -> None:
    _, res, _ = make(9)
    use(res, "a", "h1")
    res.take_changes()
    assert res.acquire("a", 3, content_hash="h1") and res.take_changes().place == []  # same content: a hit
    assert not res.acquire("a", 3, content_hash="h2"), "h1 is still referenced"
    assert res.is_stale("a")
    res.release("a")
    assert res.acquire("a", 3, content_hash="h2")
    changes = res.take_changes()
    assert changes.evict == ["a"] and changes.content_hashes == {"a": "h2"}
    assert res.acquire("a", 3, content_hash=None) and res.refs("a") == 2, "no hash accepts the current copy"
    res.release("a")
    res.release("a")
    assert res.acquire("a", 3, content_hash="h3"), "unreferenced: replaced at once"
    changes = res.take_changes()
    assert changes.evict == ["a"] and [p.name for p in changes.place] == ["a"]


def test_invalidating_a_pinned_copy_keeps_the_pin_for_the_new_content() -> None:
    _, res, _ = make(9)
    res.pin("a")
    res.prefetch([], SIZES.__getitem__, 9, hash_of=lambda n: "h1")
    res.invalidate("a")
    assert not res.is_resident("a") and res.is_pinned("a")
    res.prefetch([], SIZES.__getitem__, 9, hash_of=lambda n: "h2")
    assert res.content_hash("a") == "h2"


# ---- prefetch ----------------------------------------------------------------------------------
def test_prefetch_uses_only_free_pages() -> None:
    alloc, res, _ = make(10)
    use(res, "a")
    use(res, "b")
    kv = alloc.allocate(3, KV)
    assert alloc.num_free == 1
    assert res.prefetch(["e", "d", "c"], SIZES.__getitem__, budget_pages=10) == []
    assert sorted(res.resident_names()) == ["a", "b"], "prefetch never evicts"
    alloc.free(kv)
    placed = res.prefetch(["e", "d", "c"], SIZES.__getitem__, budget_pages=10)
    assert [p.name for p in placed] == ["e"], "queue order; d (2 pages) no longer fits in what is left"
    assert alloc.num_free == 0 and sorted(res.resident_names()) == ["a", "b", "e"]


def test_prefetch_respects_the_budget_and_skips_residents() -> None:
    alloc, res, _ = make(20)
    use(res, "a")
    placed = res.prefetch(["a", "b", "e", "b", "d"], SIZES.__getitem__, budget_pages=5)
    assert [p.name for p in placed] == ["b", "d"], "a is resident, e (4) would pass the budget after b"
    changes = res.take_changes()
    assert [p.name for p in changes.place] == ["a", "b", "d"]
    assert res.totals.prefetches == 2 and res.totals.loads == 3


def test_a_prefetched_adapter_is_a_hit_when_its_request_comes() -> None:
    _, res, _ = make(20)
    res.prefetch(["b"], SIZES.__getitem__, budget_pages=20)
    res.take_changes()
    use(res, "b")
    use(res, "b")
    u = res.usage("b")
    assert u is not None and (u.hits, u.misses, u.prefetch_hits, u.loads, u.prefetches) == (2, 0, 1, 1, 1)
    assert res.totals.hit_rate() == 1.0


def test_predictor_extends_the_prefetch_candidates() -> None:
    predictor = ArrivalPredictor(PredictorConfig(horizon_s=2.0, bin_s=0.5, min_gaps=3, threshold=0.5))
    _, res, clock = make(20, predictor=predictor)
    for _ in range(6):
        res.note_arrival("c")
        clock.t += 3.0
    clock.t -= 1.5  # 1.5 s after the last arrival of a 3 s beat
    placed = res.prefetch(["a"], SIZES.__getitem__, budget_pages=20)
    assert [p.name for p in placed] == ["a", "c"], "queued adapters first, then predicted ones"
    res.forget("c")
    assert predictor.probability("c", clock.t) == 0.0


# ---- counters and stats ------------------------------------------------------------------------
def test_counters_and_snapshot() -> None:
    _, res, clock = make(9, "cost")
    for name in "aab":
        use(res, name)
    res.take_changes()
    res.record_load_ms("a", 4.0)
    res.record_load_ms("a", 6.0)
    with pytest.raises(ValueError):
        res.record_load_ms("a", -1.0)
    assert res.acquire("c", 3)
    assert res.make_room(3)
    res.set_queued(["c"])
    res.pin("c")
    snap = res.snapshot(rank_of=lambda n: 8)
    assert snap["policy"] == "cost"
    assert (snap["hits"], snap["misses"], snap["loads"], snap["evictions"]) == (1, 3, 3, 1)
    assert snap["hit_rate"] == pytest.approx(0.25)
    assert snap["load_ms_mean"] == pytest.approx(5.0) and snap["load_ms_total"] == pytest.approx(10.0)
    assert snap["evictions_per_s"] == pytest.approx(0.1)
    rows = {r["name"]: r for r in snap["adapters"]}  # type: ignore[union-attr]
    assert set(rows) == set(res.resident_names()) and len(rows) == 2
    first = snap["adapters"][0]  # type: ignore[index]
    assert first["name"] == "c" and first["refs"] == 1 and first["pinned"] and first["queued"]
    assert first["rank"] == 8 and first["misses"] == 1
    for row in rows.values():
        assert {"name", "pages", "refs", "hits", "misses", "loads", "evictions", "score", "pinned", "queued",
                "stale", "content_hash", "load_ms_mean"} <= set(row)
        assert isinstance(row["score"], float)
    clock.t += 11
    assert res.snapshot()["evictions_per_s"] == 0.0
    res.set_policy("lru")
    assert all(r["score"] is None for r in res.snapshot()["adapters"])  # type: ignore[union-attr]


def test_backout_undoes_the_access_count() -> None:
    alloc, res, _ = make(9)
    assert res.acquire("a", 3)
    res.release("a", backout=True)  # the scheduler could not admit the request after all
    assert (res.totals.hits, res.totals.misses) == (0, 0) and res.is_resident("a")
    assert res.acquire("a", 3)
    assert (res.totals.hits, res.totals.misses) == (0, 1), "the placing acquire is still the miss"
    res.release("a")
    assert res.acquire("a", 3)
    res.release("a", backout=True)
    assert (res.totals.hits, res.totals.misses) == (0, 1)
    u = res.usage("a")
    assert u is not None and u.frequency(res.usage("a").last_used) == pytest.approx(1.0, abs=0.05)


def test_forget_clears_counters_and_refuses_a_referenced_adapter() -> None:
    _, res, _ = make(9)
    assert res.acquire("a", 3)
    with pytest.raises(ValueError, match="in use"):
        res.forget("a")
    res.release("a")
    res.forget("a")
    assert res.usage("a") is None and not res.is_resident("a")
