"""SLO admission control with early abort (S-LoRA §4.3), for any policy (torch-free).

Before each iteration the queue is walked in the order the policy would admit
it, and every request's time to first token is predicted from what is ahead of
it (prefill tokens, free batch seats) and the learned step cost. A request
predicted past the TTFT SLO is aborted at once, so the ones behind it stop
paying for work that would miss anyway; the requests that can still make it
are served in the policy's order. It never aborts a request that has already
produced a token, nor one that would start now with nobody waiting behind it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from loraplex.daemon.scheduler.sequence import Sequence

if TYPE_CHECKING:
    from loraplex.daemon.scheduler.base import BaseScheduler

OVERLOADED = "overloaded"  # predicted to miss the SLO: the server has too much queued
TIMEOUT = "timeout"  # it has already waited longer than the SLO


@dataclass(frozen=True, slots=True)
class EarlyAbort:
    """A queued request the scheduler gave up on; the daemon answers it with an error of
    `code` (an ipc ErrorCode value: "overloaded" or "timeout")."""

    request_id: str
    code: str
    message: str
    predicted_ttft_s: float
    waited_s: float


class SloAdmission:
    """default_slo_s: the TTFT SLO of requests that bring none of their own (None: only
    requests with their own `ttft_slo_s` can be aborted)."""

    def __init__(self, default_slo_s: float | None) -> None:
        if default_slo_s is not None and not (math.isfinite(default_slo_s) and default_slo_s > 0):
            raise ValueError("the TTFT SLO must be a positive number of seconds")
        self.default_slo_s = default_slo_s

    def select(self, sched: BaseScheduler, now: float) -> list[tuple[Sequence, EarlyAbort]]:
        """The queued requests to abort now, with why."""
        cfg = sched.config
        order = sched.admission_order()
        if not order:
            return []
        decoding = [s for s in sched.running if s.num_uncomputed <= 1]
        # Prefill tokens per step once the running decodes have their one token each.
        per_step = max(1, cfg.max_batched_tokens - len(decoding))
        step_s = sched.cost.predict_s(min(cfg.max_batched_tokens, len(decoding) + per_step))
        ahead = sum(s.num_uncomputed for s in sched.running if s.num_uncomputed > 1)
        seat_free_s = self._seat_times(sched)
        free_seats = cfg.max_num_seqs - len(sched.running)
        aborts: list[tuple[Sequence, EarlyAbort]] = []
        kept = 0
        for i, seq in enumerate(order):
            own = seq.num_uncomputed - (0 if seq.num_computed else seq.expected_cached)
            prefill_s = math.ceil((ahead + own) / per_step) * step_s
            seat_s = 0.0
            if kept >= free_seats:
                seat_s = _nth_free(seat_free_s, kept - free_seats)
            waited = now - seq.arrival
            predicted = waited + max(prefill_s, seat_s)
            starts_now = kept == 0 and ahead == 0 and free_seats > 0
            alone = i == len(order) - 1
            slo = seq.req.ttft_slo_s if seq.req.ttft_slo_s is not None else self.default_slo_s
            started = bool(seq.output_ids)  # preempted after its first token: TTFT already met
            if slo is not None and predicted > slo and not started and not (starts_now and alone):
                code = TIMEOUT if waited > slo else OVERLOADED
                why = ("waited {:.3f} s, past the {:.3f} s TTFT SLO" if code == TIMEOUT else
                       "predicted time to first token {:.3f} s exceeds the {:.3f} s TTFT SLO")
                aborts.append((seq, EarlyAbort(
                    request_id=seq.request_id, code=code,
                    message=why.format(waited if code == TIMEOUT else predicted, slo),
                    predicted_ttft_s=predicted, waited_s=waited)))
                continue
            ahead += own
            kept += 1
        return aborts

    @staticmethod
    def _seat_times(sched: BaseScheduler) -> list[float]:
        """Seconds until each running sequence is predicted to finish, soonest first."""
        decode_s = sched.cost.predict_s(max(1, len(sched.running)))
        times = []
        for seq in sched.running:
            total = sched.predictor.predict(seq.req.adapter, seq.req.max_tokens)
            left = max(1, total - len(seq.output_ids))
            times.append(left * decode_s)
        return sorted(times)


def _nth_free(free_at: list[float], n: int) -> float:
    """When the n-th (0-based) seat beyond the free ones opens: seats are reused in turn,
    each later round waiting for the slowest of the previous one."""
    if not free_at:
        return 0.0
    rounds, idx = divmod(n, len(free_at))
    return free_at[idx] + rounds * free_at[-1]
