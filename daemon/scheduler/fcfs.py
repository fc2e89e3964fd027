"""First-come-first-served iteration-level scheduler with continuous batching.

Torch-free policy: once per iteration it turns the queue into a StepPlan
(running sequences first, then waiting ones in arrival order, prefill chunks
and decodes mixed under one token budget). When the head of the queue cannot
be admitted nothing overtakes it, unless it only waits for its adapter to
arrive (admit_when_loaded). Paging, preemption and results live in
base.py; with `cluster_adapters` the next request admitted is the first whose
adapter already runs (bounded by `cluster_max_skips`: clustering.py).
"""
from __future__ import annotations

from typing import ClassVar

from loraplex.daemon.scheduler.base import BaseScheduler
from loraplex.daemon.scheduler.config import SchedulerConfig
from loraplex.daemon.scheduler.sequence import SeqStatus

__all__ = ["FcfsScheduler", "SchedulerConfig"]


class FcfsScheduler(BaseScheduler):
    policy: ClassVar[str] = "fcfs"

    def _plan(self, now: float) -> None:
        for seq in list(self.running):
            if self.draft.budget == 0:
                break
            if seq.status is SeqStatus.RUNNING:  # else preempted by an earlier sequence in this loop
                self._run(seq, min(seq.num_uncomputed, self.draft.budget))
        candidates = list(self.waiting)
        while candidates and self.draft.budget > 0:
            seq = self._pick(candidates)
            if not self._admit(seq, min(seq.num_uncomputed, self.draft.budget)) and not self.awaiting_load(seq):
                break  # FCFS: the head waits, nothing overtakes it
            candidates.remove(seq)
