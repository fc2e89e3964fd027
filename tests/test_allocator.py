"""The unified page allocator: pages are owned by exactly one tag at a time, the
free count is conserved, and corrupt frees raise without changing anything."""
from __future__ import annotations

import random

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from loraplex.daemon.memory.allocator import ADAPTER, KV, OutOfPages, PageAllocator

TAGS = (KV, ADAPTER, "scratch")


class AllocatorMachine(RuleBasedStateMachine):
    """Random allocate/free sequences checked against a model of who owns what."""

    @initialize(num_pages=st.integers(1, 48))
    def setup(self, num_pages: int) -> None:
        self.alloc = PageAllocator(num_pages)
        self.owned: dict[int, str] = {}  # model: page -> tag
        self.blocks: list[list[int]] = []  # what was handed out, in blocks, not yet freed

    @rule(n=st.integers(0, 20), tag=st.sampled_from(TAGS))
    def allocate(self, n: int, tag: str) -> None:
        free_before = self.alloc.num_free
        assert self.alloc.can_allocate(n) == (n <= free_before)
        if n > free_before:
            with pytest.raises(OutOfPages) as err:
                self.alloc.allocate(n, tag)
            assert (err.value.wanted, err.value.free) == (n, free_before)
            assert self.alloc.num_free == free_before  # a refused allocation takes nothing
            return
        pages = self.alloc.allocate(n, tag)
        assert len(pages) == n
        assert len(set(pages)) == n, "a page handed out twice in one call"
        for p in pages:
            assert 0 <= p < self.alloc.num_pages
            assert p not in self.owned, f"page {p} handed out while still owned by {self.owned[p]!r}"
            self.owned[p] = tag
        self.blocks.append(pages)

    @precondition(lambda self: self.blocks)
    @rule(data=st.data())
    def free_part_of_a_block(self, data: st.DataObject) -> None:
        i = data.draw(st.integers(0, len(self.blocks) - 1))
        block = self.blocks[i]
        chosen = data.draw(st.lists(st.sampled_from(block), unique=True)) if block else []
        self.alloc.free(chosen)
        for p in chosen:
            del self.owned[p]
        rest = [p for p in block if p not in chosen]
        if rest:
            self.blocks[i] = rest
        else:
            del self.blocks[i]

    @precondition(lambda self: self.owned)
    @rule(data=st.data())
    def corrupt_free_changes_nothing(self, data: st.DataObject) -> None:
        good = data.draw(st.sampled_from(sorted(self.owned)))
        kind = data.draw(st.sampled_from(["duplicate", "never_allocated", "out_of_range"]))
        if kind == "duplicate":
            bad = [good, good]
        elif kind == "never_allocated":
            unowned = [p for p in range(self.alloc.num_pages) if p not in self.owned]
            if not unowned:
                return
            bad = [good, data.draw(st.sampled_from(unowned))]
        else:
            bad = [good, self.alloc.num_pages + data.draw(st.integers(0, 5))]
        before = self.alloc.usage()
        with pytest.raises(ValueError):
            self.alloc.free(bad)
        assert self.alloc.usage() == before, "a refused free must not free the valid pages in it"

    @invariant()
    def conserved(self) -> None:
        usage = self.alloc.usage()
        assert usage.total == self.alloc.num_pages
        assert usage.free == self.alloc.num_free == self.alloc.num_pages - len(self.owned)
        expected: dict[str, int] = {}
        for tag in self.owned.values():
            expected[tag] = expected.get(tag, 0) + 1
        assert usage.by_tag == expected


AllocatorMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
TestAllocatorStateful = AllocatorMachine.TestCase


def test_exhausting_and_refilling_the_pool_hands_out_every_page_once() -> None:
    seed = random.randrange(1 << 32)
    rng = random.Random(seed)
    n = rng.randint(1, 200)
    alloc = PageAllocator(n)
    got: list[int] = []
    while alloc.num_free:
        got += alloc.allocate(rng.randint(1, alloc.num_free), rng.choice(TAGS))
    assert sorted(got) == list(range(n)), f"seed {seed}"
    with pytest.raises(OutOfPages):
        alloc.allocate(1, KV)
    rng.shuffle(got)
    alloc.free(got)
    assert alloc.num_free == n and alloc.usage().by_tag == {}
    assert sorted(alloc.allocate(n, KV)) == list(range(n))


def test_double_free_raises() -> None:
    alloc = PageAllocator(8)
    pages = alloc.allocate(3, KV)
    alloc.free(pages[:1])
    with pytest.raises(ValueError, match="not allocated"):
        alloc.free(pages[:1])
    with pytest.raises(ValueError, match="not allocated"):
        alloc.free(pages[1:] + pages[:1])  # valid pages first, the stale one last
    assert alloc.num_free == 6
    assert alloc.usage().by_tag == {KV: 2}


def test_free_of_foreign_page_raises() -> None:
    alloc = PageAllocator(4)
    alloc.allocate(2, ADAPTER)
    for foreign in (-1, 4, 1000):
        with pytest.raises(ValueError):
            alloc.free([foreign])
    assert alloc.num_free == 2


def test_duplicates_in_one_free_call_raise_and_free_nothing() -> None:
    alloc = PageAllocator(4)
    pages = alloc.allocate(2, KV)
    with pytest.raises(ValueError, match="duplicates"):
        alloc.free([pages[0], pages[1], pages[0]])
    assert alloc.num_free == 2
    alloc.free(pages)
    assert alloc.num_free == 4


def test_out_of_pages_carries_wanted_and_free() -> None:
    alloc = PageAllocator(10)
    alloc.allocate(7, KV)
    with pytest.raises(OutOfPages) as err:
        alloc.allocate(5, ADAPTER)
    assert err.value.wanted == 5 and err.value.free == 3
    assert "5" in str(err.value) and "3" in str(err.value)
    assert isinstance(err.value, RuntimeError)


def test_argument_validation() -> None:
    for bad in (0, -3):
        with pytest.raises(ValueError):
            PageAllocator(bad)
    alloc = PageAllocator(2)
    with pytest.raises(ValueError):
        alloc.allocate(-1, KV)
    assert alloc.allocate(0, KV) == []
    assert alloc.usage().by_tag == {}
    alloc.free([])
    assert alloc.num_free == 2
