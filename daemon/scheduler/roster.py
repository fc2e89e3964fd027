"""The sequences one scheduler holds (torch-free): the queue, the batch, each by request id, and
how many bring their own TTFT SLO (early abort runs for them even without a default SLO).

Owns membership only: what a sequence holds (KV pages, its adapter's reference) is given back by
the scheduler before the sequence leaves the batch (base.py).
"""
from __future__ import annotations

from collections import deque

from loraplex.daemon.scheduler.sequence import SeqStatus, Sequence


class Roster:
    def __init__(self) -> None:
        self.waiting: deque[Sequence] = deque()  # arrival order; a preempted sequence goes back to the head
        self.running: list[Sequence] = []  # admission order: the newest is preempted first
        self.by_id: dict[str, Sequence] = {}
        self.own_slo = 0  # sequences held that bring their own TTFT SLO

    def get(self, request_id: str) -> Sequence | None:
        return self.by_id.get(request_id)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.by_id

    def queue(self, seq: Sequence) -> None:
        """`seq` joins the tail of the queue."""
        self.waiting.append(seq)
        self.by_id[seq.request_id] = seq
        if seq.req.ttft_slo_s is not None:
            self.own_slo += 1

    def requeue(self, seq: Sequence) -> None:
        """Take over a sequence whose KV was lost with its engine: with no KV, it is recomputed
        from its prompt and the tokens it already produced."""
        if seq.request_id in self.by_id:
            raise ValueError(f"request {seq.request_id!r} is already queued")
        seq.kv_pages = []
        seq.released_pages = 0
        seq.cached_blocks = 0
        seq.prefix_open = True
        seq.num_computed = 0
        seq.status = SeqStatus.WAITING
        self.queue(seq)

    def start(self, seq: Sequence) -> None:
        """A queued `seq` enters the batch."""
        if self.waiting and self.waiting[0] is seq:
            self.waiting.popleft()
        else:
            self.waiting.remove(seq)
        seq.status = SeqStatus.RUNNING
        self.running.append(seq)

    def leave(self, seq: Sequence) -> None:
        """`seq` is no longer held here (finished, cancelled, aborted or handed over); the caller
        has taken it out of the queue or the batch."""
        self.by_id.pop(seq.request_id, None)
        if seq.req.ttft_slo_s is not None:
            self.own_slo -= 1
