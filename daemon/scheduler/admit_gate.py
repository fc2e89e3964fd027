"""Whether a queued sequence may enter the batch of the plan being built (torch-free), and the
resources it enters with: a seat (max_num_seqs, max_loras_per_batch), its adapter's pages, the
cached prefix it starts from and the KV pages of its first chunk. Owns the requests this plan
leaves queued on purpose: those waiting for their adapter to arrive (admit_when_loaded), for
their engine to compile their grammar (grammar_book.py) or for a running prefill to compute the
prompt page they share, with a seat and pages held for them.

It never moves a sequence between the queue and the batch, and never preempts: the scheduler
does both (base.py).
"""
from __future__ import annotations

from typing import Callable

from loraplex.daemon.memory.adapter_residency import AdapterResidency
from loraplex.daemon.scheduler.config import SchedulerConfig
from loraplex.daemon.scheduler.grammar_book import GrammarBook
from loraplex.daemon.scheduler.kv_pages import KvPages
from loraplex.daemon.scheduler.prefix_reuse import PrefixReuse
from loraplex.daemon.scheduler.sequence import Sequence


class AdmitGate:
    """`running`: the scheduler's batch (read only)."""

    def __init__(self, config: SchedulerConfig, adapters: AdapterResidency, kv: KvPages, prefix: PrefixReuse,
                 adapter_pages: Callable[[str], int], running: list[Sequence], grammars: GrammarBook) -> None:
        self.config = config
        self.grammars = grammars
        self.adapters = adapters
        self.kv = kv
        self.prefix = prefix
        self.adapter_pages = adapter_pages
        self.running = running
        self.awaiting: set[str] = set()  # request ids this plan left queued while their adapter arrives

    def forget_awaiting(self) -> None:
        """Start a planning pass with no one waiting for an adapter: a pass planned again must not
        keep the seats and pages the pass it replaces reserved (the waiting request itself could
        no longer fit beside its own reservation: dLoRA, found by the property tests)."""
        self.awaiting = set()
        self.kv.held = 0

    def enter(self, seq: Sequence, n: int, merged_adapter: str | None, planning: bool) -> int | None:
        """Seat `seq` with its first `n` tokens: its adapter referenced, its cached prefix taken and
        the KV pages of its chunk allocated; returns the tokens to feed now. None (and nothing
        changed) when a seat, the adapter's pages or the KV pages are not there, or it waits.
        `planning`: the plan being built has rows already."""
        if not self._has_seat(seq):
            return None
        if seq.num_preemptions and not self.kv.context_fits(seq):
            return None
        if self.awaiting and not self._leaves_room_for_awaiting(seq, n):
            return None
        if self.prefix.in_flight(seq, self.running, merged_adapter):
            # Wait a step or two for a running sequence to compute (and cache) the prompt pages
            # this one shares with it, instead of computing them twice (n > 1 siblings, a burst
            # of one system prompt); like a request awaiting its adapter, others may pass it.
            self._await(seq, n)
            return None
        if self.grammars.must_wait(seq.req.sampling, planning or bool(self.running)):
            self._await(seq, n)  # its grammar compiles off the step meanwhile; others may pass it
            return None
        adapter = seq.req.adapter
        if adapter is not None and self._must_await_load(adapter, planning):
            if self.adapters.place_ahead(adapter, self.adapter_pages(adapter), self.config.load_groups):
                self._await(seq, n)
                seq.waited_for_adapter = True
            return None
        if adapter is not None and not self.adapters.acquire(adapter, self.adapter_pages(adapter),
                                                             self.config.load_groups):
            return None
        n = self.prefix.reuse(seq, n, merged_adapter)
        if not self.kv.grow(seq, n):
            self.kv.drop(seq)
            seq.num_computed = 0
            if adapter is not None:
                self.adapters.release(adapter, backout=True)
            return None
        return n

    def _has_seat(self, seq: Sequence) -> bool:
        if len(self.running) >= self.config.max_num_seqs:
            return False
        limit = self.config.max_loras_per_batch
        adapter = seq.req.adapter
        if limit and adapter is not None:
            active = {s.req.adapter for s in self.running if s.req.adapter is not None}
            return adapter in active or len(active) < limit
        return True

    def _must_await_load(self, adapter: str, planning: bool) -> bool:
        """With admit_when_loaded, a request whose adapter is not yet fully on the GPU waits in
        the queue while it loads, rather than stalling every row of the step on the copy; when
        nothing else would run it is admitted at once and the step overlaps the load."""
        return (self.config.admit_when_loaded and (planning or bool(self.running))
                and not self.adapters.is_ready(adapter)
                and self.adapters.refs(adapter) == 0)  # a running user's rows wait for it anyway

    def _leaves_room_for_awaiting(self, seq: Sequence, n: int) -> bool:
        """A request may pass those waiting for their adapter only with a seat and free pages
        to spare for them, so that passing never delays them once their copy is in."""
        if len(self.running) + len(self.awaiting) >= self.config.max_num_seqs:
            return False
        return self.kv.spare_for(seq, n)

    def _await(self, seq: Sequence, n: int) -> None:
        """Leave `seq` queued for this plan, holding back a seat and the pages of its first `n` tokens."""
        self.awaiting.add(seq.request_id)
        self.kv.hold(seq, n)
