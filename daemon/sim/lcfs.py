"""Last-come-first-served: a simulator-only baseline scheduler (torch-free).

S-LoRA §4.3 compares early abort against FCFS and LCFS under overload. The daemon
offers no LCFS policy (nobody should run it), so this baseline lives with the
simulator: FCFS's planning with the queue walked newest first. Running sequences
still go first, and a blocked candidate stops admission just as in FCFS.
"""
from __future__ import annotations

from typing import ClassVar
from typing import Sequence as Seq

from loraplex.daemon.scheduler.fcfs import FcfsScheduler
from loraplex.daemon.scheduler.sequence import Sequence


class LcfsScheduler(FcfsScheduler):
    policy: ClassVar[str] = "lcfs"

    def admission_order(self) -> list[Sequence]:
        return list(reversed(self.waiting))

    def _pick(self, candidates: Seq[Sequence]) -> Sequence:
        # FCFS's _plan offers the queue oldest first; the newest is the candidate here.
        return super()._pick(list(reversed(candidates)))
