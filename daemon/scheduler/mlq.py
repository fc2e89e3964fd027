"""Non-preemptive multi-level queues by weighted request size (Chameleon §4.2), torch-free.

Every request gets WRS = A·input + B·predicted output + C·rank over features
normalised by their recent means (A, B, C = 0.3, 0.5, 0.2); the output length
comes from the shared per-adapter quantile predictor. Queue count and WRS
cut-offs come from K-means (K <= 4, WCSS elbow) over recent WRS, re-fitted
every `refit_every` arrivals. Each iteration, after the running decodes, the
token budget is split into per-queue quotas by the square-root capacity
assignment of an M/M/1 network (offered load plus a share of the spare
capacity ∝ sqrt(load)), so small requests are not stuck behind large ones yet
every queue moves. Quota a queue cannot use goes to the others, from the
highest-priority (smallest-WRS) queue down. A blocked queue head may be
bypassed only by requests predicted to finish before the head's expected wait
ends, at most `max_bypass` times; an overdue head is served first (adapter
clustering does not pass it) and, while blocked, reserves the pool (no bypass),
so nothing starves.
"""
from __future__ import annotations

import bisect
import math
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, ClassVar

from loraplex.contracts.geometry import PageGeometry
from loraplex.daemon.memory.allocator import PageAllocator
from loraplex.daemon.scheduler.base import BaseScheduler, Clock
from loraplex.daemon.scheduler.config import SchedulerConfig
from loraplex.daemon.scheduler.kmeans import choose_clusters
from loraplex.daemon.scheduler.sequence import SeqStatus, Sequence


@dataclass(frozen=True, slots=True)
class MlqConfig:
    weights: tuple[float, float, float] = (0.3, 0.5, 0.2)  # A (input), B (predicted output), C (rank)
    max_queues: int = 4
    window: int = 512  # recent arrivals the fit looks at
    refit_every: int = 64  # arrivals between re-fits
    min_fit_samples: int = 16  # arrivals before the first fit (one queue until then)
    elbow_min_gain: float = 0.5  # one more queue must remove this share of the WCSS left
    max_bypass: int = 4  # times one blocked queue head may be overtaken
    max_utilization: float = 0.95  # cap on the load estimate used for the quotas

    def __post_init__(self) -> None:
        if len(self.weights) != 3 or min(self.weights) < 0 or sum(self.weights) <= 0:
            raise ValueError("MLQ weights must be three non-negative numbers, not all zero")
        if not 1 <= self.max_queues <= 4:
            raise ValueError("max_queues must be between 1 and 4")
        if min(self.window, self.refit_every, self.min_fit_samples) <= 0 or self.max_bypass < 0:
            raise ValueError("MLQ window, refit_every and min_fit_samples must be positive, max_bypass >= 0")
        if not 0 < self.elbow_min_gain < 1 or not 0 < self.max_utilization < 1:
            raise ValueError("elbow_min_gain and max_utilization must lie in (0, 1)")


def sqrt_shares(loads: list[float], utilization: float) -> list[float]:
    """Capacity shares minimising mean delay in a set of M/M/1 queues (Kleinrock's square-root
    assignment): each queue gets its offered load, the spare capacity is split ∝ sqrt(load).
    `loads` are relative (any scale); shares sum to 1."""
    total = sum(loads)
    if total <= 0:
        return [1.0 / len(loads)] * len(loads)
    rho = [x / total for x in loads]
    roots = [math.sqrt(r) for r in rho]
    u = min(max(utilization, 0.0), 1.0)
    return [u * r + (1 - u) * s / sum(roots) for r, s in zip(rho, roots)]


class MlqScheduler(BaseScheduler):
    policy: ClassVar[str] = "mlq"

    def __init__(self, config: SchedulerConfig, geometry: PageGeometry, allocator: PageAllocator,
                 adapter_pages: Callable[[str], int], eos_token_ids: tuple[int, ...] = (), *,
                 adapter_rank: Callable[[str], int] | None = None, clock: Clock = time.monotonic,
                 mlq: MlqConfig | None = None) -> None:
        super().__init__(config, geometry, allocator, adapter_pages, eos_token_ids, adapter_rank=adapter_rank,
                         clock=clock)
        self.mlq = mlq or MlqConfig()
        self._window: deque[tuple[float, int, int, int]] = deque(maxlen=self.mlq.window)  # (t, in, out, rank)
        self._scale = (1.0, 1.0, 1.0)
        self.cutoffs: tuple[float, ...] = ()  # WRS boundaries between queues, ascending
        self.shares: tuple[float, ...] = (1.0,)  # capacity share per queue
        self.fits = 0
        self._since_fit = 0
        self._level: dict[str, int] = {}
        self._deadline: dict[str, float] = {}  # when a queued request's expected wait ends
        self._wait_steps: dict[str, float] = {}  # its expected wait in full steps, as seen at its arrival
        self._bypassed: dict[str, int] = {}
        self._blocked: Sequence | None = None  # first blocked head of this iteration
        self._served: dict[int, int] = {}  # queue -> tokens its prefills got in the last plan

    # ---- classification -----------------------------------------------------------------------
    @property
    def num_queues(self) -> int:
        return len(self.shares)

    def level_of(self, request_id: str) -> int:
        return self._level[request_id]

    def lanes(self) -> list[dict[str, object]]:
        """One row per queue, highest priority first: its waiting requests, the tokens its prefills
        got in the last plan against its share of a full step's budget (running decodes come
        before any quota), its oldest request's wait and its upper WRS cut-off (None: the last)."""
        now, full, last = self._clock(), self.config.max_batched_tokens, len(self.shares) - 1
        waiting: dict[int, list[Sequence]] = {}
        for seq in self.waiting:
            waiting.setdefault(min(self._level.get(seq.request_id, 0), last), []).append(seq)
        rows: list[dict[str, object]] = []
        for level, share in enumerate(self.shares):
            queue = waiting.get(level, [])
            rows.append({"name": f"q{level}", "depth": len(queue), "share": share,
                         "quota_used": self._served.get(level, 0), "quota_total": round(share * full),
                         "oldest_wait_ms": 1e3 * max(0.0, now - min(s.arrival for s in queue)) if queue else None,
                         "wrs_cutoff": self.cutoffs[level] if level < len(self.cutoffs) else None})
        return rows

    def wrs(self, input_len: int, output_len: int, rank: int) -> float:
        a, b, c = self.mlq.weights
        si, so, sr = self._scale
        return a * input_len / si + b * output_len / so + c * rank / sr

    def _features(self, seq: Sequence) -> tuple[int, int, int]:
        req = seq.req
        # The input a request costs is what the prefix cache does not already hold.
        return seq.prefill_len, self.predictor.predict(req.adapter, req.max_tokens), self.adapter_rank(req.adapter)

    def _classify(self, seq: Sequence) -> None:
        self._level[seq.request_id] = bisect.bisect_right(self.cutoffs, self.wrs(*self._features(seq)))

    def _on_add(self, seq: Sequence) -> None:
        feats = self._features(seq)
        self._window.append((seq.arrival, *feats))
        self._since_fit += 1
        if self._since_fit >= (self.mlq.refit_every if self.fits else self.mlq.min_fit_samples):
            self._refit()
        self._classify(seq)
        level = self._level[seq.request_id]
        ahead = sum(s.num_uncomputed for s in self.waiting
                    if s is not seq and self._level.get(s.request_id) == level)
        self._wait_steps[seq.request_id] = self._expected_steps(level, ahead + seq.num_uncomputed)
        self._set_deadline(seq)

    def _expected_steps(self, level: int, tokens: int) -> float:
        """Fluid-queue wait in full steps: the queue drains `tokens` at its share of each step."""
        full = self.config.max_batched_tokens
        return max(1.0, tokens / max(1e-9, self.shares[min(level, len(self.shares) - 1)] * full))

    def _set_deadline(self, seq: Sequence) -> None:
        """Arrival plus its expected wait at the current estimate of a full step's duration.
        Re-set at every refit, so a request that arrived while the cost model still held its
        prior does not keep the deadline the prior made (4x too late in the property tests:
        every request of a stream arriving after it went first). The wait in steps stays as
        seen at arrival, so later refits of the queue shares cannot push a deadline out."""
        step_s = self.cost.predict_s(self.config.max_batched_tokens)
        self._deadline[seq.request_id] = seq.arrival + self._wait_steps[seq.request_id] * step_s

    def _refit(self) -> None:
        self._since_fit = 0
        samples = list(self._window)
        if not samples:
            return
        # Means of token counts and ranks; at least 1, so a feature that was all zeros stays small.
        self._scale = tuple(max(1.0, sum(s[i] for s in samples) / len(samples)) for i in (1, 2, 3))
        values = [self.wrs(i, o, r) for _, i, o, r in samples]
        clustering = choose_clusters(values, self.mlq.max_queues, min_gain=self.mlq.elbow_min_gain)
        self.cutoffs = clustering.cutoffs
        loads = [0.0] * clustering.k
        for (_, i, o, _), v in zip(samples, values):
            loads[bisect.bisect_right(self.cutoffs, v)] += i + o
        self.shares = tuple(sqrt_shares(loads, self._utilization(samples)))
        self.fits += 1
        for seq in list(self.waiting) + self.running:
            self._classify(seq)
            if seq.status is SeqStatus.WAITING and seq.request_id in self._wait_steps:
                self._set_deadline(seq)

    def _utilization(self, samples: list[tuple[float, int, int, int]]) -> float:
        span = samples[-1][0] - samples[0][0]
        if len(samples) < 2 or span <= 0:
            return self.mlq.max_utilization
        full = self.config.max_batched_tokens
        capacity = full / self.cost.predict_s(full)  # tokens per second at a full step
        offered = sum(i + o for _, i, o, _ in samples) / span
        return min(self.mlq.max_utilization, offered / capacity)

    def admission_order(self) -> list[Sequence]:
        return sorted(self.waiting, key=lambda s: self._level.get(s.request_id, 0))  # stable: arrival within

    # ---- planning -----------------------------------------------------------------------------
    def _plan(self, now: float) -> None:
        prefilling: dict[int, list[Sequence]] = {}
        self._served = {}
        for seq in list(self.running):  # non-preemptive: running decodes always go first
            if self.draft.budget == 0:
                break
            if seq.status is not SeqStatus.RUNNING:
                continue
            if seq.num_uncomputed <= 1:
                self._run(seq, seq.num_uncomputed)
            else:
                prefilling.setdefault(self._level[seq.request_id], []).append(seq)
        waiting: dict[int, list[Sequence]] = {}
        for seq in self.waiting:
            waiting.setdefault(self._level[seq.request_id], []).append(seq)
        levels = sorted(set(prefilling) | set(waiting))
        if not levels or self.draft.budget == 0:
            return
        order = self._service_order(levels, waiting, now)
        quotas = self._quotas(order, self.draft.budget)
        self._blocked = None
        for level in order:
            self._serve(level, quotas[level], prefilling, waiting, now)
        for level in levels:  # spare quota, from the highest-priority queue down
            if self.draft.budget == 0:
                break
            self._serve(level, self.draft.budget, prefilling, waiting, now)
        self._served = {level: sum(self.draft.planned(s) for s in seqs) for level, seqs in prefilling.items()}

    def _service_order(self, levels: list[int], waiting: dict[int, list[Sequence]], now: float) -> list[int]:
        """Queues whose head is past its expected wait first (most overdue first), then by priority."""
        late = []
        for level in levels:
            queue = waiting.get(level)
            if queue:
                overdue = self._overdue_s(queue[0], now)
                if overdue > 0:
                    late.append((-overdue, level))
        first = [level for _, level in sorted(late)]
        return first + [level for level in levels if level not in first]

    def _quotas(self, order: list[int], budget: int) -> dict[int, int]:
        if budget < len(order):  # too little for everyone: one token each, in service order
            return {level: int(i < budget) for i, level in enumerate(order)}
        shares = {level: self.shares[min(level, len(self.shares) - 1)] for level in order}
        total = sum(shares.values())
        quotas = {level: max(1, int(budget * share / total)) for level, share in shares.items()}
        while sum(quotas.values()) > budget:  # the minimum of one token overshot: trim the largest
            biggest = max(quotas, key=quotas.get)
            quotas[biggest] -= 1
        for level in sorted(order)[: budget - sum(quotas.values())]:
            quotas[level] += 1  # rounding remainder to the highest priorities
        return quotas

    def _serve(self, level: int, quota: int, prefilling: dict[int, list[Sequence]],
               waiting: dict[int, list[Sequence]], now: float) -> None:
        quota = min(quota, self.draft.budget)
        for seq in prefilling.get(level, ()):
            if quota <= 0:
                break
            left = seq.num_uncomputed - self.draft.planned(seq)
            before = self.draft.budget
            if left > 0 and self._run(seq, min(left, quota)):
                quota -= before - self.draft.budget
        queue = waiting.get(level, [])
        while queue and quota > 0 and self.draft.budget > 0:
            seq = self._next(queue, now)
            n = min(seq.num_uncomputed, quota)
            if self._try_admit(seq, n, now):
                queue.remove(seq)
                prefilling.setdefault(level, []).append(seq)
                quota -= n
                continue
            if self.awaiting_load(seq):  # not blocked: its adapter is on its way
                queue.remove(seq)
                continue
            if self._blocked is None:
                self._blocked = seq
            for cand in [c for c in queue if c is not seq]:  # bounded head-of-line bypass
                if quota <= 0:
                    break
                n = min(cand.num_uncomputed, quota)
                if self._try_admit(cand, n, now):
                    queue.remove(cand)
                    prefilling.setdefault(level, []).append(cand)
                    quota -= n
            return

    def _next(self, queue: list[Sequence], now: float) -> Sequence:
        """The queue's overdue head, else adapter clustering's pick: clustering may pass over
        a head only until its expected wait ends, or with one seat a stream of base-model
        requests kept an overdue adapter request out for cluster_max_skips admissions, once
        per queue it sat in (found by the property tests)."""
        head = queue[0]
        return head if self._overdue_s(head, now) > 0 else self._pick(queue)

    def _overdue_s(self, seq: Sequence, now: float) -> float:
        """How far past its expected wait a queued request is (<= 0: not yet)."""
        return now - self._deadline.get(seq.request_id, now)

    def _try_admit(self, seq: Sequence, n: int, now: float) -> bool:
        head = self._blocked
        if head is None or head is seq or head.status is not SeqStatus.WAITING:
            return self._admit(seq, n)
        if not self._may_bypass(head, seq, now) or not self._admit(seq, n):
            return False
        self._bypassed[head.request_id] = self._bypassed.get(head.request_id, 0) + 1
        return True

    def _may_bypass(self, head: Sequence, seq: Sequence, now: float) -> bool:
        """`seq` may overtake the blocked `head` only if it is predicted to be done (and its
        pages free again) before the head's expected wait ends, and only max_bypass times."""
        if self._bypassed.get(head.request_id, 0) >= self.mlq.max_bypass:
            return False
        return now + self._service_time(seq) <= self._deadline.get(head.request_id, now)

    def _service_time(self, seq: Sequence) -> float:
        level = self._level[seq.request_id]
        full = self.config.max_batched_tokens
        quota = max(1.0, self.shares[min(level, len(self.shares) - 1)] * full)
        prefill_steps = math.ceil(seq.num_uncomputed / quota)
        decode_steps = self.predictor.predict(seq.req.adapter, seq.req.max_tokens)
        return (prefill_steps + decode_steps) * self.cost.predict_s(max(1, len(self.running) + 1))

    def _on_finish(self, seq: Sequence) -> None:
        rid = seq.request_id
        for table in (self._level, self._deadline, self._wait_steps, self._bypassed):
            table.pop(rid, None)
        if self._blocked is seq:
            self._blocked = None
