"""Prefix-cache reuse for the scheduler (torch-free): the cached pages a sequence entering the
batch starts from, whether it should wait for a running prefill computing the same prompt page,
and which full pages a sequence has computed join the cache.

Owns the PrefixCache (None: scheduler.prefix_cache is off, or the model's every layer slides:
SchedulerConfig.kv_window, whose pages leave the pool as they leave the window). It never allocates KV pages: a
sequence's own pages come from the scheduler's page accounting (kv_pages.py).
"""
from __future__ import annotations

import logging
from typing import Callable, Iterable

from loraplex.daemon.memory.allocator import PageAllocator
from loraplex.daemon.memory.prefix_cache import PrefixCache
from loraplex.daemon.scheduler.config import SchedulerConfig
from loraplex.daemon.scheduler.lookahead import PENDING
from loraplex.daemon.scheduler.sequence import SeqRequest, Sequence

log = logging.getLogger("loraplex.daemon")


def runs_merged(adapter: str | None, merged_adapter: str | None) -> bool:
    """Whether a row of `adapter` runs merged into the base weights (dLoRA): its KV differs in
    rounding from the unmerged path's, so the two are cached apart."""
    return adapter is not None and adapter == merged_adapter


def reuses_prefix(req: SeqRequest) -> bool:
    """Whether a request may start from cached pages. Not when its sampling needs every token it
    has seen fed to the engine (penalties, a grammar: the sampler rebuilds that history from the
    rows it runs), nor when it asks for prompt logprobs (the logits of every prompt position: the
    cache keeps KV, not logits, so the whole prompt is computed again and never read stale)."""
    return not req.sampling.needs_history and req.sampling.prompt_logprobs < 0


class PrefixReuse:
    def __init__(self, config: SchedulerConfig, allocator: PageAllocator, page_tokens: int,
                 clock: Callable[[], float]) -> None:
        self.page_tokens = page_tokens
        self.cache: PrefixCache | None = None
        if config.prefix_cache and config.kv_window is not None:
            # A cached page is shared and chained: given back out of one sequence's window while a
            # later page of the chain stays held, it would count as evictable and not be (an interior
            # block), and keeping it held would hold the whole prompt. Pages leave windows instead.
            log.info("prefix cache off: every attention layer of this model slides (window %d tokens), so "
                     "pages out of a sequence's window go back to the pool instead", config.kv_window)
        elif config.prefix_cache:
            unified = config.prefix_eviction == "unified"
            budget = None if unified else int(allocator.num_pages * config.prefix_cache_share)
            self.cache = PrefixCache(allocator, page_tokens, clock, max_pages=budget)

    def expected(self, req: SeqRequest) -> int:
        """Prompt tokens the cache holds for a request being queued (what policies cost it)."""
        if self.cache is None or req.sampling.prompt_logprobs >= 0:
            return 0
        return self.cache.peek(req.adapter, req.prompt_ids)

    def reuse(self, seq: Sequence, n: int, merged_adapter: str | None) -> int:
        """A sequence entering the batch with no KV takes the longest cached prefix of its tokens
        (computed with its adapter) as computed; returns the tokens to feed now, at most `n`."""
        if not self.may_reuse(seq):
            return n
        merged = runs_merged(seq.req.adapter, merged_adapter)
        pages = self.cache.match(seq.req.adapter, seq.token_slice(0, seq.num_tokens), merged)
        if not pages:
            return n
        seq.kv_pages = pages
        seq.cached_blocks = len(pages)
        seq.num_computed = len(pages) * self.page_tokens
        if seq.first_scheduled is None:
            seq.cached_tokens = seq.num_computed
        return min(n, seq.num_uncomputed)

    def may_reuse(self, seq: Sequence) -> bool:
        """A sequence with no KV may start from cached pages, unless its request must compute its
        whole prompt (reuses_prefix)."""
        return self.cache is not None and not seq.kv_pages and not seq.num_computed and reuses_prefix(seq.req)

    def in_flight(self, seq: Sequence, running: Iterable[Sequence], merged_adapter: str | None) -> bool:
        """Whether a running sequence with the same adapter will soon offer the cache the next full
        page of `seq`'s prompt that it does not hold yet: computing it in its prefill, or computed
        by a step launched ahead whose result has not come (overlap: its pages join the cache then)."""
        if not self.may_reuse(seq):
            return False
        # Cheap first (this runs at every admission attempt): a running sequence of its adapter with
        # a full prompt page it has not offered the cache yet.
        adapter, prompt = seq.req.adapter, seq.req.prompt_ids
        size = self.page_tokens
        prefilling = [o for o in running if o.req.adapter == adapter and o.prefix_open
                      and (o.cached_blocks + 1) * size <= len(o.req.prompt_ids) - 1]
        if not prefilling:
            return False
        start = self.cache.peek(adapter, prompt, runs_merged(adapter, merged_adapter))
        if len(prompt) - start <= size:
            return False  # no full page left to share (its last token is computed anyway)
        block = prompt[start:start + size]
        for other in prefilling:
            theirs = other.req.prompt_ids
            if other.cached_blocks * size <= start and start + size <= len(theirs) - 1 \
                    and theirs[start:start + size] == block:
                return True
        return False

    def offer(self, seq: Sequence, merged_adapter: str | None, upto: int | None = None) -> None:
        """Offer the full pages `seq` has computed (its first `upto` tokens, when launched steps
        count more as computed than the engine has reported) to the prefix cache."""
        size = self.page_tokens
        computed = seq.num_computed if upto is None else min(upto, seq.num_computed)
        full = min(computed // size, len(seq.kv_pages))
        first = seq.cached_blocks
        if self.cache is None or not seq.prefix_open or full <= first:
            return
        tokens = seq.token_slice(first * size, full * size)
        if PENDING in tokens:
            return  # a launched step's token not known yet: offered when its result comes
        merged = runs_merged(seq.req.adapter, merged_adapter)
        seq.cached_blocks = self.cache.insert(seq.req.adapter, seq.kv_pages, first, tokens, merged)
        seq.prefix_open = seq.cached_blocks == full

    def release(self, kv_pages: list[int]) -> list[int]:
        """A sequence gives back `kv_pages`: cached ones lose its reference; returns its own, to free."""
        return kv_pages if self.cache is None else self.cache.release(kv_pages)
