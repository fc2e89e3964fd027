"""KV page accounting for the scheduler (torch-free): how many pages of the unified pool a
sequence needs (at worst, for its next chunk, with its adapter placed), whether they are there,
the free pages held back for requests waiting for their adapter, and giving pages back: all of a
sequence's when it leaves, and on a sliding-window model (SchedulerConfig.kv_window) its leading
pages as they fall wholly out of the window of its next token.

It allocates and frees KV pages and asks adapter residency for room, but never decides whom to
preempt or admit: that is the scheduler's (base.py).
"""
from __future__ import annotations

from typing import Callable, Iterable

from loraplex.contracts.geometry import PageGeometry
from loraplex.daemon.memory.adapter_residency import AdapterResidency
from loraplex.daemon.memory.allocator import KV, PageAllocator
from loraplex.daemon.scheduler.config import SchedulerConfig
from loraplex.daemon.scheduler.prefix_reuse import PrefixReuse
from loraplex.daemon.scheduler.sequence import SeqRequest, Sequence
from loraplex.errors import CapacityError


class KvPages:
    def __init__(self, config: SchedulerConfig, geometry: PageGeometry, allocator: PageAllocator,
                 adapters: AdapterResidency, adapter_pages: Callable[[str], int], prefix: PrefixReuse) -> None:
        self.config = config
        self.geometry = geometry
        self.allocator = allocator
        self.adapters = adapters
        self.adapter_pages = adapter_pages
        self.prefix = prefix
        self.held = 0  # free pages held back for requests awaiting their adapter: the KV of their first chunk
        # What a released page's entry in a page table becomes: the page one past those the allocator
        # hands out (the engine's scratch page), which no sequence owns and no kernel reads for it.
        self.placeholder = allocator.num_pages
        self.released = 0  # pages given back out of sliding windows, over the scheduler's life

    def worst(self, req: SeqRequest) -> int:
        """KV pages a request needs at most (the whole prompt is prefilled even past
        max_model_len, so it bounds the need from below). On a sliding-window model a sequence
        holds at most the window before its chunk and the chunk: released pages come back."""
        worst_len = max(len(req.prompt_ids), min(len(req.prompt_ids) + req.max_tokens, self.config.max_model_len))
        pages = self.geometry.kv_pages_for(worst_len)
        window = self.config.kv_window
        if window is None:
            return pages
        # keys from p0 - window + 1 (rounded down to a page start) through the chunk's last, p0 + n - 1
        return min(pages, self.geometry.kv_pages_for(window - 1 + self.config.max_batched_tokens) + 1)

    def slide(self, seq: Sequence, unsettled: int = 0) -> int:
        """Give back the leading pages of `seq` wholly before the window of its next token (at
        position num_computed, which attends to keys from num_computed - window + 1 on: neither
        kernel nor the torch path reads an earlier one); returns how many. They are freed (with a
        window the prefix cache is off, so none is shared); the table keeps the placeholder in
        their place, so positions still index it. `unsettled`: its tokens that launched steps
        (scheduler.overlap) count as computed: the window is taken from before them, since those
        steps may still read older keys and a failed one is planned again from there. Admission
        needs no call: a sequence enters with nothing computed (the prefix cache is off)."""
        window = self.config.kv_window
        if window is None:
            return 0
        settled = seq.num_computed - unsettled
        out = min(max(0, settled - window + 1) // self.geometry.page_tokens, len(seq.kv_pages))
        first = seq.released_pages
        if out <= first:
            return 0
        self.allocator.free(seq.kv_pages[first:out])
        seq.kv_pages[first:out] = [self.placeholder] * (out - first)
        seq.released_pages = out
        self.released += out - first
        return out - first

    def held_pages(self, seq: Sequence) -> int:
        """KV pages `seq` holds in the pool (its table less the released entries)."""
        return len(seq.kv_pages) - seq.released_pages

    def check_pool(self, req: SeqRequest) -> None:
        """CapacityError when the whole pool could not hold the request at its longest, with its adapter."""
        need = self.worst(req)
        if req.adapter is not None:
            need += self.adapter_pages(req.adapter)
        if need > self.allocator.num_pages:
            raise CapacityError(
                f"request {req.request_id!r} needs up to {need} pages; the pool has {self.allocator.num_pages}"
            )

    def context_fits(self, seq: Sequence) -> bool:
        """Whether all the KV `seq` can still need fits in free and reclaimable pages. A preempted
        sequence comes back only then: admitted on its first chunk alone, it could run out of
        pages again and preempt itself, over and over, while the sequence holding the pages
        never got the token budget to finish (MLQ, a one-token budget: found by the property
        tests). Its own adapter, resident but unreferenced while it waits, is counted once: as
        pages it keeps, not also as reclaimable room for its KV (counted twice, a preempted
        sequence came back into a pool one page short and preempted itself again, forever:
        MLQ, seen once in two runs of the suite)."""
        need = self.wanted(seq, self.worst(seq.req))
        room = self.allocator.num_free + self.adapters.reclaimable_pages()
        adapter = seq.req.adapter
        if adapter is not None and adapter in self.adapters.eviction_order():
            room -= len(self.adapters.resident_pages(adapter))
        return need <= room

    def wanted(self, seq: Sequence, kv_pages: int) -> int:
        """Pages `seq` still lacks to hold `kv_pages` of KV, with its adapter placed."""
        need = kv_pages - len(seq.kv_pages)
        adapter = seq.req.adapter
        if adapter is not None and not self.adapters.is_resident(adapter):
            need += self.adapter_pages(adapter)
        return need

    def chunk(self, seq: Sequence, n: int) -> int:
        """KV pages `seq` lacks to compute its next `n` tokens."""
        return self.geometry.kv_pages_for(seq.num_computed + n) - len(seq.kv_pages)

    def hold(self, seq: Sequence, n: int) -> None:
        """Keep free pages back for the first `n` tokens of a request left waiting (for its adapter
        or a prefix being computed), so that those who pass it never delay it."""
        self.held += self.chunk(seq, n)

    def spare_for(self, seq: Sequence, n: int) -> bool:
        """Whether the pages `seq` needs for its next `n` tokens are free beside those held back."""
        return self.wanted(seq, self.geometry.kv_pages_for(seq.num_computed + n)) <= self.allocator.num_free - self.held

    def grow(self, seq: Sequence, n: int) -> bool:
        """Give `seq` the KV pages its next `n` tokens lack, making room by evicting what nobody
        holds (idle adapters, cached prefixes); False, and nothing allocated, when there is none."""
        need = self.chunk(seq, n)
        if need > 0 and not self.adapters.make_room(need):
            return False
        self.allocate(seq, need)
        return True

    def allocate(self, seq: Sequence, need: int) -> None:
        """Give `seq` `need` more KV pages (room for them was made)."""
        if need > 0:
            seq.kv_pages += self.allocator.allocate(need, KV)

    def drop(self, seq: Sequence) -> None:
        """Give back `seq`'s KV pages: its own are freed, cached ones lose its reference."""
        self.allocator.free(self.prefix.release(seq.kv_pages[seq.released_pages:]))
        seq.kv_pages = []
        seq.released_pages = 0
        seq.cached_blocks = 0
        seq.prefix_open = True

    def release(self, seq: Sequence) -> None:
        """`seq` leaves the batch: its KV pages and its reference to its adapter go."""
        self.drop(seq)
        if seq.req.adapter is not None:
            self.adapters.release(seq.req.adapter)

    def prefetch(self, waiting: Iterable[Sequence]) -> None:
        """Place adapters that queued requests will need into free pages, keeping what the head
        of the queue needs next in reserve (a prefetch never evicts and never delays the head)."""
        queue = list(waiting)
        if not queue:
            return
        head = queue[0]
        reserve = self.wanted(head, self.geometry.kv_pages_for(head.num_tokens + 1))
        budget = self.allocator.num_free - reserve - self.held
        if budget <= 0:
            return
        wanted = list(dict.fromkeys(s.req.adapter for s in queue[:32] if s.req.adapter is not None))
        self.adapters.prefetch(wanted, self.adapter_pages, budget, load_groups=self.config.load_groups)
