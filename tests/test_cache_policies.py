"""Eviction order of each cache policy on hand-built access sequences (none, lru, fifo, cost),
and the rules every policy obeys: referenced adapters stay, queued ones outlast the rest."""
from __future__ import annotations

from dataclasses import dataclass

import pytest

from loraplex.daemon.gpu_cache.policies import POLICY_NAMES, CostPolicy, CostWeights, make_policy
from loraplex.daemon.memory.adapter_residency import AdapterResidency
from loraplex.daemon.memory.allocator import ADAPTER, KV, PageAllocator


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def make(num_pages: int, policy: str = "lru", **kw: object) -> tuple[PageAllocator, AdapterResidency, Clock]:
    alloc, clock = PageAllocator(num_pages), Clock()
    return alloc, AdapterResidency(alloc, policy, clock=clock, **kw), clock  # type: ignore[arg-type]


def use(res: AdapterResidency, name: str, pages: int, clock: Clock | None = None, dt: float = 1.0) -> None:
    if clock is not None:
        clock.t += dt
    assert res.acquire(name, pages)
    res.release(name)


# ---- lru / fifo / none -----------------------------------------------------------------------
def test_lru_evicts_the_least_recently_used() -> None:
    _, res, _ = make(9, "lru")
    for name in "abc":
        use(res, name, 3)
    use(res, "a", 3)
    assert res.eviction_order() == ["b", "c", "a"]
    assert res.make_room(3) and res.resident_names() == ["c", "a"]


def test_fifo_evicts_the_first_placed_whatever_its_use() -> None:
    _, res, _ = make(9, "fifo")
    for name in "abc":
        use(res, name, 3)
    use(res, "a", 3)  # a use does not move a in FIFO order
    assert res.eviction_order() == ["a", "b", "c"]
    assert res.make_room(3) and sorted(res.resident_names()) == ["b", "c"]
    use(res, "a", 3)  # placed again: now the newest
    assert res.eviction_order() == ["b", "c", "a"]


def test_none_frees_on_last_release() -> None:
    alloc, res, _ = make(10, "none")
    assert res.acquire("a", 4) and res.acquire("a", 4)
    res.take_changes()
    res.release("a")
    assert res.is_resident("a"), "still referenced once"
    res.release("a")
    assert not res.is_resident("a") and alloc.num_free == 10
    changes = res.take_changes()
    assert changes.evict == ["a"] and changes.place == []
    assert res.totals.evictions == 1 and res.totals.loads == 1


def test_none_placed_and_freed_before_a_plan_sends_nothing() -> None:
    alloc, res, _ = make(10, "none")
    use(res, "a", 4)
    changes = res.take_changes()
    assert changes.place == [] and changes.evict == [] and alloc.num_free == 10
    assert res.totals.loads == 0, "a placement no plan carried is not a load"


# ---- cost ------------------------------------------------------------------------------------
@dataclass
class View:
    name: str
    num_pages: int
    placed_tick: int
    last_used: float
    freq: float

    def frequency(self, now: float) -> float:
        return self.freq


def test_cost_score_normalisation() -> None:
    views = [View("hot", 2, 1, 90.0, 8.0), View("big", 8, 2, 80.0, 2.0), View("new", 4, 3, 100.0, 1.0)]
    scores = CostPolicy().scores(views, now=100.0)
    # ages 10 / 20 / 0 -> recency 0.5 / 0 / 1; freq percentile 1 / .5 / 0; size .25 / 1 / .5
    assert scores["hot"] == pytest.approx(0.45 * 1 + 0.10 * 0.5 + 0.45 * 0.25)
    assert scores["big"] == pytest.approx(0.45 * 0.5 + 0.10 * 0.0 + 0.45 * 1)
    assert scores["new"] == pytest.approx(0.45 * 0.0 + 0.10 * 1 + 0.45 * 0.5)
    assert [v.name for v in CostPolicy().order(views, 100.0)] == ["new", "hot", "big"]


def test_cost_frequency_is_a_percentile_robust_to_a_heavy_head() -> None:
    views = [View("head", 2, 1, 0.0, 1000.0), View("warm", 2, 2, 0.0, 3.0), View("cold", 2, 3, 0.0, 1.0),
             View("twin", 2, 4, 0.0, 1.0)]
    scores = CostPolicy(CostWeights(frequency=1.0, recency=0.0, size=0.0)).scores(views, 0.0)
    assert scores == pytest.approx({"head": 1.0, "warm": 2 / 3, "cold": 0.0, "twin": 0.0})
    single = CostPolicy(CostWeights(frequency=1.0, recency=0.0, size=0.0))
    assert single.scores(views[:1], 0.0) == {"head": 1.0}


def test_cost_single_terms() -> None:
    views = [View("a", 2, 1, 10.0, 5.0), View("b", 8, 2, 50.0, 1.0), View("c", 4, 3, 30.0, 3.0)]
    by = lambda w: [v.name for v in CostPolicy(w).order(views, 60.0)]  # noqa: E731
    assert by(CostWeights(frequency=1, recency=0, size=0)) == ["b", "c", "a"]
    assert by(CostWeights(frequency=0, recency=1, size=0)) == ["a", "c", "b"]
    assert by(CostWeights(frequency=0, recency=0, size=1)) == ["a", "c", "b"]


def test_cost_ties_go_to_the_least_recently_used() -> None:
    views = [View("old", 2, 1, 10.0, 1.0), View("mid", 2, 2, 10.0, 1.0)]
    assert [v.name for v in CostPolicy().order(views, 20.0)] == ["old", "mid"]


def test_cost_keeps_a_frequent_adapter_that_lru_would_evict() -> None:
    orders = {}
    for policy in ("lru", "cost"):
        _, res, clock = make(6, policy)
        for _ in range(6):
            use(res, "hot", 2, clock)
        use(res, "x", 2, clock)
        use(res, "y", 2, clock)
        orders[policy] = res.eviction_order()
        assert res.acquire("z", 2)
        res.release("z")
        assert not res.is_resident(orders[policy][0])
    assert orders["lru"][0] == "hot"
    assert orders["cost"][0] == "x"  # same size: x has the lowest frequency and is older than y


def test_cost_keeps_larger_adapters_longer() -> None:
    # Frequency off, the default R and S weights: size against recency.
    _, cost, clock = make(20, "cost", weights=CostWeights(frequency=0.0))
    _, lru, lru_clock = make(20, "lru")
    for res, c in ((cost, clock), (lru, lru_clock)):
        use(res, "large", 16, c)
        use(res, "small", 2, c, dt=5.0)
        c.t += 5
    assert lru.eviction_order() == ["large", "small"]
    assert cost.eviction_order() == ["small", "large"], "size outweighs recency"


def test_cost_with_default_weights_trades_size_against_frequency() -> None:
    _, res, clock = make(40, "cost")
    for _ in range(3):
        use(res, "popular-small", 2, clock)
    use(res, "rare-large", 16, clock)
    use(res, "rare-small", 2, clock)
    # freq percentile 1 / 0 / .5 (decay ranks rare-large below rare-small), recency 0 / .5 / 1,
    # size .125 / 1 / .125: scores .506 / .500 / .381.
    assert res.eviction_order() == ["rare-small", "rare-large", "popular-small"]


def test_frequency_decays_with_the_half_life() -> None:
    _, res, clock = make(12, "cost", weights=CostWeights(half_life_s=10.0))
    for _ in range(4):
        use(res, "a", 2, clock, dt=0.0)
    usage = res.usage("a")
    assert usage is not None and usage.frequency(clock.t) == pytest.approx(4.0)
    assert usage.frequency(clock.t + 10.0) == pytest.approx(2.0)
    assert usage.frequency(clock.t + 20.0) == pytest.approx(1.0)
    clock.t += 10.0
    res.set_policy("cost", CostWeights(half_life_s=5.0))  # the count so far stays, the decay changes
    assert usage.frequency(clock.t) == pytest.approx(2.0)
    assert usage.frequency(clock.t + 5.0) == pytest.approx(1.0)


def test_cost_weights_validate() -> None:
    for bad in (dict(frequency=-1.0), dict(frequency=0.0, recency=0.0, size=0.0), dict(half_life_s=0.0)):
        with pytest.raises(ValueError):
            CostWeights(**bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown adapter eviction policy"):
        make_policy("random")


# ---- rules for every policy -------------------------------------------------------------------
@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_referenced_adapters_are_never_evicted(policy: str) -> None:
    alloc, res, clock = make(10, policy)
    assert res.acquire("busy", 4)
    assert res.acquire("idle", 4)
    res.take_changes()
    res.release("idle")
    expect_idle = policy != "none"
    assert res.is_resident("idle") == expect_idle
    assert not res.make_room(7 if expect_idle else 7 + 4), "not enough reclaimable pages"
    assert res.is_resident("busy")
    assert res.make_room(6)
    assert res.resident_names() == ["busy"] and alloc.usage().by_tag == {ADAPTER: 4}
    with pytest.raises(ValueError, match="in use"):
        res.drop("busy")


@pytest.mark.parametrize("policy", ["lru", "fifo", "cost"])
def test_queued_adapters_outlast_unqueued_ones(policy: str) -> None:
    _, res, clock = make(9, policy)
    for name in "abc":
        use(res, name, 3, clock)
    res.set_queued(["a", None])  # None: a waiting base-model request
    order = res.eviction_order()
    assert order[-1] == "a" and sorted(order[:2]) == ["b", "c"]
    assert res.make_room(6)
    assert res.resident_names() == ["a"], "the unqueued adapters went first"
    assert res.make_room(9), "memory forces it: the queued adapter goes too"
    assert res.resident_names() == []


def test_cache_shrinks_under_kv_pressure_and_grows_back() -> None:
    alloc, res, clock = make(20, "lru")
    for name in "abcd":
        use(res, name, 4, clock)
    assert alloc.num_free == 4 and res.reclaimable_pages() == 16
    assert res.make_room(10)
    kv = alloc.allocate(10, KV)
    assert res.resident_names() == ["c", "d"] and alloc.num_free == 2
    assert not res.make_room(11), "KV may take the cache, never more"
    alloc.free(kv)
    for name in "abe":
        use(res, name, 4, clock)
    assert sorted(res.resident_names()) == ["a", "b", "c", "d", "e"] and alloc.num_free == 0
    usage = alloc.usage()
    assert usage.by_tag == {ADAPTER: 20}
