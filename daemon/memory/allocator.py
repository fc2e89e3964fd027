"""The unified page allocator: one free list of page indices shared by KV
entries and adapter weights (S-LoRA unified paging).

Torch-free bookkeeping only: it never touches tensors. Every page is owned by
exactly one tag ("kv" or "adapter") while allocated; double frees and frees of
pages never handed out raise, because they mean corrupted page tables.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

KV = "kv"
ADAPTER = "adapter"


class OutOfPages(RuntimeError):
    """Not enough free pages for the request."""

    def __init__(self, wanted: int, free: int) -> None:
        super().__init__(f"need {wanted} pages, {free} free")
        self.wanted = wanted
        self.free = free


@dataclass(frozen=True, slots=True)
class PoolUsage:
    total: int
    free: int
    by_tag: dict[str, int]


class PageAllocator:
    def __init__(self, num_pages: int) -> None:
        if num_pages <= 0:
            raise ValueError("num_pages must be positive")
        self.num_pages = num_pages
        # LIFO free list: recently freed pages are reused first (warm in cache).
        self._free: list[int] = list(range(num_pages - 1, -1, -1))
        self._owner: dict[int, str] = {}
        self._by_tag: Counter[str] = Counter()  # pages owned per tag: usage() is read by every stats snapshot

    @property
    def num_free(self) -> int:
        return len(self._free)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int, tag: str) -> list[int]:
        if n < 0:
            raise ValueError("page count must be non-negative")
        if n > len(self._free):
            raise OutOfPages(n, len(self._free))
        pages = [self._free.pop() for _ in range(n)]
        for p in pages:
            self._owner[p] = tag
        self._by_tag[tag] += n
        return pages

    def free(self, pages: list[int]) -> None:
        if len(set(pages)) != len(pages):
            raise ValueError("page list freed with duplicates")
        for p in pages:
            if p not in self._owner:
                raise ValueError(f"page {p} freed but not allocated")
        for p in pages:
            self._by_tag[self._owner.pop(p)] -= 1
            self._free.append(p)

    def usage(self) -> PoolUsage:
        by_tag = {tag: n for tag, n in self._by_tag.items() if n}
        return PoolUsage(total=self.num_pages, free=len(self._free), by_tag=by_tag)
