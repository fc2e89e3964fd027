"""The host tier's bookkeeping (daemon/host_tier.py), torch-free: victims in LRU
order, busy and pinned adapters never chosen, and bytes that always balance."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loraplex.daemon.host_tier import HostTier


def test_victims_are_least_recently_used_first_and_cover_the_need():
    tier = HostTier(1000)
    for name in "abcd":
        tier.add(name, 200)
    tier.touch("a")  # order now b, c, d, a
    assert tier.victims(needed=300, free=200) == ["b"]
    assert tier.victims(needed=500, free=200) == ["b", "c"]
    assert tier.victims(needed=300, free=400) == ["b"]  # fragmented free bytes: one at a time
    assert tier.victims(needed=2000, free=200) == []  # cannot be covered: evict nothing


def test_busy_and_pinned_adapters_are_never_victims():
    tier = HostTier(600)
    for name in "abc":
        tier.add(name, 200)
    tier.pin("a")
    assert tier.victims(needed=200, free=0, busy={"b"}) == ["c"]
    assert tier.victims(needed=400, free=0, busy={"b"}) == []
    tier.unpin("a")
    assert tier.victims(needed=400, free=0, busy={"b"}) == ["a", "c"]


def test_accounting_and_counters():
    tier = HostTier(500)
    tier.add("a", 300, load_ms=2.0)
    with pytest.raises(ValueError):
        tier.add("b", 300)
    assert tier.remove("a", evicted=True) == 300 and tier.remove("a") == 0
    tier.record_hit("disk")
    with pytest.raises(ValueError):
        tier.record_hit("tape")
    tier.add("b", 100)
    tier.reset()
    snap = tier.snapshot()
    assert snap["used_bytes"] == 0 and snap["adapters"] == 0 and snap["loads"] == 2 and snap["evictions"] == 1
    assert snap["restarts"] == 1 and snap["hits"] == {"gpu": 0, "host": 0, "disk": 1} and snap["load_ms"] == 2.0


NAMES = st.sampled_from("abcdefgh")
OPS = st.lists(st.one_of(
    st.tuples(st.just("add"), NAMES, st.integers(1, 400)),
    st.tuples(st.just("remove"), NAMES, st.booleans()),
    st.tuples(st.just("touch"), NAMES, st.none()),
    st.tuples(st.just("pin"), NAMES, st.booleans()),
    st.tuples(st.just("evict_for"), st.frozensets(NAMES, max_size=4), st.integers(1, 1200)),
    st.tuples(st.just("reset"), st.none(), st.none()),
), max_size=60)


@settings(max_examples=200, deadline=None)
@given(OPS)
def test_bytes_always_balance_and_victims_respect_busy_and_pins(ops):
    tier = HostTier(1000)
    pinned: set[str] = set()
    for op, a, b in ops:
        if op == "add":
            if tier.used - tier.size_of(a) + b <= tier.capacity:
                tier.add(a, b)
        elif op == "remove":
            tier.remove(a, evicted=b)
        elif op == "touch":
            tier.touch(a)
        elif op == "pin":
            (tier.pin if b else tier.unpin)(a)
            (pinned.add if b else pinned.discard)(a)
        elif op == "evict_for":
            victims = tier.victims(needed=b, free=tier.free, busy=a)
            assert not set(victims) & (a | pinned)
            assert len(set(victims)) == len(victims) and all(tier.is_resident(v) for v in victims)
            if victims and b > tier.free:
                assert tier.free + sum(tier.size_of(v) for v in victims) >= b
            lru = [n for n in tier.resident_names() if n not in a | pinned]
            assert victims == lru[:len(victims)]
            for victim in victims:
                tier.remove(victim, evicted=True)
        else:
            tier.reset()
        assert tier.used == sum(tier.size_of(n) for n in tier.resident_names())
        assert 0 <= tier.used <= tier.capacity and tier.free == tier.capacity - tier.used


def test_the_host_tier_and_its_driver_import_without_torch():
    import subprocess
    import sys

    code = ("import sys, loraplex.daemon.host_tier, loraplex.daemon.host_service, loraplex.daemon.host_loads, "
            "loraplex.daemon.cache_link; "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
