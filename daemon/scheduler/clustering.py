"""Adapter clustering for admission (scheduler.cluster_adapters), torch-free: the next queued
request to admit is the first whose adapter already runs, so a batch carries fewer adapters, but
a request passed over `cluster_max_skips` times goes next regardless (no one starves).

Owns how often each queued request was passed over; it never admits anyone itself.
"""
from __future__ import annotations

import itertools
from typing import Iterable
from typing import Sequence as Seq

from loraplex.daemon.scheduler.config import SchedulerConfig
from loraplex.daemon.scheduler.sequence import Sequence


class AdapterClustering:
    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self._skips: dict[str, int] = {}  # request id -> times passed over
        self._passed: tuple[Sequence, list[Sequence]] | None = None  # the last pick, and whom it passed

    def pick(self, candidates: Seq[Sequence], running: Iterable[Sequence]) -> Sequence:
        """The next candidate to admit: the first, or with adapter clustering the first whose
        adapter already runs (base-model requests always share), unless one was passed over
        `cluster_max_skips` times."""
        if not self.config.cluster_adapters or len(candidates) == 1:
            return candidates[0]
        limit = self.config.cluster_max_skips
        for seq in candidates:
            if self._skips.get(seq.request_id, 0) >= limit:
                return seq
        active = {s.req.adapter for s in running}
        for i, seq in enumerate(candidates):
            if seq.req.adapter is None or seq.req.adapter in active:
                self._passed = (seq, list(itertools.islice(candidates, i)))  # counted if `seq` is admitted
                return seq
        return candidates[0]

    def admitted(self, seq: Sequence) -> None:
        """`seq` entered the batch: if it was the last pick, those it passed were passed over once more."""
        self._skips.pop(seq.request_id, None)
        if self._passed is not None and self._passed[0] is seq:
            for skipped in self._passed[1]:
                self._skips[skipped.request_id] = self._skips.get(skipped.request_id, 0) + 1
        self._passed = None

    def forget(self, request_id: str) -> None:
        """The request left this scheduler."""
        self._skips.pop(request_id, None)
