"""Automatic prefix caching in the unified pool: full KV pages kept after their sequence
leaves, found again by the exact tokens they hold and the adapter that computed them.

A cached page is a block of the pool's page size in tokens. Its key is its parent block's
page and its own tokens; a first block's key is the adapter (None: the base model) and its
tokens. So a chain of keys is the whole prefix, and a prefix is shared only where its KV is
truly identical: the same tokens at the same positions, computed with the same adapter
(the scheduler forgets an adapter's blocks when its content may change). Keys are compared
exactly, never by a hash, so two prefixes can never be confused.

Sharing rules: only full pages are cached, and they are never written again (a sequence
reusing a prefix computes at least its last prompt token itself, on a page of its own).
A page is reference-counted by the running sequences whose page tables hold it. At zero
references it stays cached in otherwise idle pages and is evicted, leaves first (a block
whose children are cached stays, or the children would hang under a page reused by
another block), least recently used first, when the pool needs room. Torch-free.
"""
from __future__ import annotations

import heapq
import itertools
import time
from dataclasses import dataclass, field
from typing import Callable, Hashable

from loraplex.daemon.memory.allocator import PageAllocator

_ROOT = "root"


@dataclass(slots=True)
class _Block:
    page: int
    key: tuple[Hashable, tuple[int, ...]]
    parent: int | None  # the parent block's page; None for a first block
    adapter: str | None
    refs: int = 0
    children: int = 0
    last_used: float = 0.0
    forgotten: bool = False  # its adapter changed: never matched again, freed once idle


@dataclass(slots=True)
class PrefixCacheCounters:
    query_tokens: int = 0  # prompt tokens of admitted requests that looked for a prefix
    hit_tokens: int = 0  # of those, tokens whose KV came from the cache
    inserted_pages: int = 0
    evicted_pages: int = 0  # evicted for room
    forgotten_pages: int = 0  # dropped because their adapter changed or left

    def as_dict(self) -> dict[str, int | float]:
        rate = self.hit_tokens / self.query_tokens if self.query_tokens else 0.0
        return {"query_tokens": self.query_tokens, "hit_tokens": self.hit_tokens, "hit_rate": round(rate, 4),
                "inserted_pages": self.inserted_pages, "evicted_pages": self.evicted_pages,
                "forgotten_pages": self.forgotten_pages}


@dataclass(slots=True)
class PrefixCache:
    allocator: PageAllocator
    page_tokens: int
    clock: Callable[[], float] = time.monotonic
    # Separate budgets (the baseline one order is measured against): at most this many pages,
    # and idle adapters leave before any prefix page. None: one order for the whole pool.
    max_pages: int | None = None
    counters: PrefixCacheCounters = field(default_factory=PrefixCacheCounters)
    _by_key: dict[tuple[Hashable, tuple[int, ...]], _Block] = field(default_factory=dict)
    _by_page: dict[int, _Block] = field(default_factory=dict)
    _idle: int = 0  # blocks at zero references (all evictable, leaves first)
    _heap: list[tuple[float, int, int]] = field(default_factory=list)  # (last_used, tiebreak, page) of idle leaves
    _tiebreak: itertools.count = field(default_factory=itertools.count)

    # ---- what the scheduler asks ------------------------------------------------------------
    @property
    def num_pages(self) -> int:
        """Pages the cache holds, referenced or not."""
        return len(self._by_page)

    @property
    def unified(self) -> bool:
        """Whether its pages and idle adapters leave the pool in one order (else adapters first)."""
        return self.max_pages is None

    @property
    def idle_pages(self) -> int:
        """Pages it holds that no sequence references: free for the pool once evicted."""
        return self._idle

    def holds(self, page: int) -> bool:
        return page in self._by_page

    def oldest_idle(self) -> float | None:
        """When the next page evict() would free was last used; None when none is idle."""
        self._drop_stale_heap_top()
        return self._heap[0][0] if self._heap else None

    def peek(self, adapter: str | None, tokens: list[int], variant: bool = False) -> int:
        """Tokens of `tokens` match() would find cached now; references and counts nothing."""
        return len(self._walk(adapter, tokens, variant)) * self.page_tokens

    def match(self, adapter: str | None, tokens: list[int], variant: bool = False) -> list[int]:
        """Pages holding the longest cached prefix of `tokens` computed with `adapter` (and its
        `variant`: merged into the base weights or not), each referenced once more for the
        caller; at least the last token is left uncached."""
        pages = self._walk(adapter, tokens, variant)
        now = self.clock()
        for page in pages:
            self._ref(self._by_page[page], now)
        self.counters.query_tokens += len(tokens)
        self.counters.hit_tokens += len(pages) * self.page_tokens
        return pages

    def insert(self, adapter: str | None, pages: list[int], first: int, tokens: list[int],
               variant: bool = False) -> int:
        """Offer blocks `first`, `first + 1`, ... of a sequence's page table, whose KV now holds
        `tokens` (the tokens of those blocks, computed, full pages only). Each page not yet
        cached joins the cache with one reference (the sequence's). Returns how many leading
        pages of the table are cached blocks now (a page whose tokens another page already
        caches stays private, and so do the pages after it)."""
        size = self.page_tokens
        stop = min(len(pages), first + len(tokens) // size)
        parent: Hashable = (_ROOT, adapter, variant) if first == 0 else pages[first - 1]
        now = self.clock()
        for i in range(first, stop):
            if self.max_pages is not None and len(self._by_page) >= self.max_pages and not self.evict(1):
                return i  # its budget is full of referenced pages
            page = pages[i]
            offset = (i - first) * size
            key = (parent, tuple(tokens[offset:offset + size]))
            if key in self._by_key or page in self._by_page:
                return i
            parent_page = None if i == 0 else pages[i - 1]
            block = _Block(page=page, key=key, parent=parent_page, adapter=adapter, refs=1, last_used=now)
            self._by_key[key] = block
            self._by_page[page] = block
            if parent_page is not None:
                self._by_page[parent_page].children += 1
            self.counters.inserted_pages += 1
            parent = page
        return stop

    def release(self, pages: list[int]) -> list[int]:
        """A sequence leaves: its cached pages lose one reference each (they stay cached);
        returns the pages that were its own, for the caller to free."""
        own: list[int] = []
        for page in pages:
            block = self._by_page.get(page)
            if block is None:
                own.append(page)
                continue
            block.refs -= 1
            if block.refs == 0:
                self._idle += 1
                if block.children == 0:
                    self._push(block)
        return own

    def evict(self, num_pages: int) -> int:
        """Free up to `num_pages` idle pages, least recently used leaves first; returns how many."""
        freed = 0
        while freed < num_pages:
            self._drop_stale_heap_top()
            if not self._heap:
                break
            _, _, page = heapq.heappop(self._heap)
            self._remove(self._by_page[page])
            freed += 1
        self.counters.evicted_pages += freed
        return freed

    def forget_adapter(self, adapter: str | None) -> None:
        """The adapter's content may have changed (replaced, removed): none of its blocks may be
        matched again. Idle ones are freed now; referenced ones leave with their last user."""
        for block in self._by_page.values():
            if block.adapter == adapter and not block.forgotten:
                block.forgotten = True
                del self._by_key[block.key]
        self._free_forgotten_idle()

    def clear_idle(self) -> None:
        """Free every idle page (the pool is needed whole, or the engine's KV was lost)."""
        self.evict(self._idle)

    def snapshot(self) -> dict[str, object]:
        return {"pages": self.num_pages, "idle_pages": self._idle, **self.counters.as_dict()}

    # ---- internals ----------------------------------------------------------------------------
    def _walk(self, adapter: str | None, tokens: list[int], variant: bool) -> list[int]:
        """Pages of the longest cached chain of full blocks of `tokens`, leaving the last token."""
        size = self.page_tokens
        pages: list[int] = []
        parent: Hashable = (_ROOT, adapter, variant)
        for start in range(0, len(tokens) - size, size):
            block = self._by_key.get((parent, tuple(tokens[start:start + size])))
            if block is None:
                break
            pages.append(block.page)
            parent = block.page
        return pages

    def _ref(self, block: _Block, now: float) -> None:
        if block.refs == 0:
            self._idle -= 1
        block.refs += 1
        block.last_used = now

    def _push(self, block: _Block) -> None:
        heapq.heappush(self._heap, (block.last_used, next(self._tiebreak), block.page))

    def _drop_stale_heap_top(self) -> None:
        """Heap entries go stale when their block was referenced again, gained a child or left."""
        heap = self._heap
        while heap:
            used, _, page = heap[0]
            block = self._by_page.get(page)
            if block is not None and block.refs == 0 and block.children == 0 and block.last_used == used:
                return
            heapq.heappop(heap)

    def _remove(self, block: _Block) -> None:
        del self._by_page[block.page]
        if self._by_key.get(block.key) is block:
            del self._by_key[block.key]
        self._idle -= 1
        self.allocator.free([block.page])
        if block.parent is not None:
            parent = self._by_page[block.parent]
            parent.children -= 1
            if parent.children == 0 and parent.refs == 0:
                self._push(parent)

    def _free_forgotten_idle(self) -> None:
        forgotten = [b for b in self._by_page.values() if b.forgotten and b.refs == 0]
        # Leaves first, so every parent is still there when its child leaves.
        while forgotten:
            leaves = [b for b in forgotten if b.children == 0]
            if not leaves:
                break
            for block in leaves:
                self._remove(block)
                self.counters.forgotten_pages += 1
            forgotten = [b for b in forgotten if b.page in self._by_page and b.refs == 0]
