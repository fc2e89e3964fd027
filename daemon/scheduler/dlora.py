"""dLoRA dynamic batching (dLoRA §4, Algorithms 1-3), torch-free: per iteration,
merged mode (one adapter folded into the base weights, only its requests run,
no LoRA cost) or unmerged mode (every adapter batched together).

Mode switch (threshold rule): unmerged → merged(L) when adapter L holds at
least α of the active requests (running + queued); merged(L) → unmerged when
L's share falls below β (after `min_merge_steps`, the switch-cost hysteresis),
or straight to merged(L') when another adapter L' has reached α.
Starvation (credits): each merged step of duration t transfers credit t·k from
the merged adapter to the k adapters (or base-model requests) it left waiting,
t to each; a group whose credit reaches `credit_limit_s` forces unmerged mode
until it has been served, which resets its credit. Debts are bounded at
-credit_limit_s, so no group waits longer than about twice the limit; a group
with no request left drops its credit or debt.
Adaptive thresholds: when a merged episode ends, its throughput (tokens/s) is
compared with the recent unmerged throughput; merging that did not pay raises
α (merge only at stronger skew), merging that paid lowers it; an episode left
by the β rule while still out-running unmerged mode lowers β (stay merged
longer), otherwise raises it. 0 <= β <= α - gap <= 1 - gap always.
"""
from __future__ import annotations

import time
from collections import Counter, deque
from dataclasses import dataclass
from typing import Callable, ClassVar

from loraplex.contracts.geometry import PageGeometry
from loraplex.daemon.memory.allocator import PageAllocator
from loraplex.daemon.scheduler.base import BaseScheduler, Clock
from loraplex.daemon.scheduler.config import SchedulerConfig
from loraplex.daemon.scheduler.sequence import SeqStatus, Sequence
from loraplex.ipc.engine_plan import StepPlan

Group = str | None  # an adapter name, or None for base-model requests


@dataclass(frozen=True, slots=True)
class DloraConfig:
    merge_threshold: float = 0.75  # α: merge the top adapter once it holds this share of active requests
    unmerge_threshold: float = 0.5  # β: unmerge once the merged adapter's share falls below this
    credit_limit_s: float = 0.5  # a group left waiting this long (in transferred credit) is served next
    min_merge_steps: int = 4  # stay merged at least this many steps (merging costs a weight rewrite)
    adapt: bool = True
    adapt_step: float = 0.05
    threshold_gap: float = 0.05  # β <= α - gap
    ema: float = 0.2  # weight of the newest sample in throughput averages

    def __post_init__(self) -> None:
        if (not 0 < self.threshold_gap < 1
                or not 0 <= self.unmerge_threshold <= self.merge_threshold - self.threshold_gap):
            raise ValueError("dLoRA thresholds need 0 <= unmerge_threshold <= merge_threshold - threshold_gap")
        if self.merge_threshold > 1:
            raise ValueError("merge_threshold is a share of requests: at most 1")
        if (self.credit_limit_s <= 0 or self.min_merge_steps < 1 or not 0 < self.adapt_step < 1
                or not 0 < self.ema <= 1):
            raise ValueError("dLoRA credit_limit_s, min_merge_steps, adapt_step and ema must be positive")


@dataclass(frozen=True, slots=True)
class ModeSwitch:
    step: int  # scheduling call at which it happened
    old: str | None
    new: str | None
    reason: str  # "threshold" | "starvation" | "drained" | "idle"


class DloraScheduler(BaseScheduler):
    policy: ClassVar[str] = "dlora"

    def __init__(self, config: SchedulerConfig, geometry: PageGeometry, allocator: PageAllocator,
                 adapter_pages: Callable[[str], int], eos_token_ids: tuple[int, ...] = (), *,
                 adapter_rank: Callable[[str], int] | None = None, clock: Clock = time.monotonic,
                 dlora: DloraConfig | None = None) -> None:
        super().__init__(config, geometry, allocator, adapter_pages, eos_token_ids, adapter_rank=adapter_rank,
                         clock=clock)
        self.dlora = dlora or DloraConfig()
        self.alpha = self.dlora.merge_threshold
        self.beta = self.dlora.unmerge_threshold
        self.merged: str | None = None
        self.credits: dict[Group, float] = {}
        self.switches: deque[ModeSwitch] = deque(maxlen=256)  # the most recent mode switches
        self.num_switches = 0
        self._calls = 0
        self._merged_steps = 0
        self._episode_tokens = 0
        self._episode_s = 0.0
        self._episode_recent_tps: float | None = None  # throughput over the episode's last steps
        self.unmerged_tps: float | None = None

    @property
    def merged_adapter(self) -> str | None:
        return self.merged

    def admission_order(self) -> list[Sequence]:
        if self.merged is None:
            return list(self.waiting)
        return sorted(self.waiting, key=lambda s: s.req.adapter != self.merged)

    # ---- Algorithm 1: one iteration ------------------------------------------------------------
    def _plan(self, now: float) -> None:
        self._calls += 1
        self._decide()
        self._plan_mode()
        if not self.draft and self.merged is not None:  # the merged adapter cannot move: let the rest run
            self._switch(None, "idle")
            self._forget_awaiting()
            self._plan_mode()

    def _plan_mode(self) -> None:
        merged = self.merged
        for seq in list(self.running):
            if self.draft.budget == 0:
                break
            if seq.status is SeqStatus.RUNNING and (merged is None or seq.req.adapter == merged):
                self._run(seq, min(seq.num_uncomputed, self.draft.budget))
        candidates = [s for s in self.waiting if merged is None or s.req.adapter == merged]
        while candidates and self.draft.budget > 0:
            seq = self._pick(candidates)
            if not self._admit(seq, min(seq.num_uncomputed, self.draft.budget)) and not self.awaiting_load(seq):
                break
            candidates.remove(seq)

    # ---- Algorithm 2: merge / unmerge by thresholds, with credits -------------------------------
    def active_groups(self) -> Counter[Group]:
        return Counter(s.req.adapter for s in (*self.running, *self.waiting))

    def _decide(self) -> None:
        groups = self.active_groups()
        merged = self.merged
        self.credits = {g: c for g, c in self.credits.items() if g in groups}  # gone: owed nothing, owes nothing
        if not groups:
            if merged is not None:
                self._switch(None, "drained")
            return
        total = sum(groups.values())
        adapters = [(n, self.credits.get(a, 0.0), a) for a, n in groups.items() if a is not None]
        top_n, _, top = max(adapters, key=lambda t: (t[0], t[1], t[2])) if adapters else (0, 0.0, None)
        top_share = top_n / total
        starving = [g for g in groups if g != merged and self.credits.get(g, 0.0) >= self.dlora.credit_limit_s]
        if merged is None:
            if top is not None and top_share >= self.alpha and not starving:
                self._switch(top, "threshold")
            return
        if starving:
            self._switch(None, "starvation")
        elif merged not in groups:
            self._switch(None, "drained")
        elif groups[merged] / total < self.beta and self._merged_steps >= self.dlora.min_merge_steps:
            self._switch(top if top != merged and top_share >= self.alpha else None, "threshold")

    def _switch(self, new: str | None, reason: str) -> None:
        old = self.merged
        if old is not None:
            self._end_episode(reason)
        self.switches.append(ModeSwitch(step=self._calls, old=old, new=new, reason=reason))
        self.num_switches += 1
        self.merged = new
        self._merged_steps = 0
        self._episode_tokens = 0
        self._episode_s = 0.0
        self._episode_recent_tps = None

    # ---- credits and throughput ------------------------------------------------------------------
    def _observe(self, plan: StepPlan, step_s: float) -> None:
        if step_s <= 0 or not plan.rows:
            return
        tps = plan.num_tokens / step_s
        merged = plan.merged_adapter
        if merged is None:
            self.unmerged_tps = self._ema(self.unmerged_tps, tps)
            for group in {row.adapter for row in plan.rows}:
                if self.credits.get(group, 0.0) > 0:
                    self.credits[group] = 0.0  # served: its wait is paid off
            return
        self._merged_steps += 1
        self._episode_tokens += plan.num_tokens
        self._episode_s += step_s
        self._episode_recent_tps = self._ema(self._episode_recent_tps, tps, weight=0.5)
        left_out = [g for g in self.active_groups() if g != merged]
        for group in left_out:  # credit transfer: the merged adapter pays each group it kept waiting
            self.credits[group] = self.credits.get(group, 0.0) + step_s
        paid = self.credits.get(merged, 0.0) - step_s * len(left_out)
        self.credits[merged] = max(-self.dlora.credit_limit_s, paid)

    def _ema(self, old: float | None, new: float, weight: float | None = None) -> float:
        w = self.dlora.ema if weight is None else weight
        return new if old is None else (1 - w) * old + w * new

    # ---- Algorithm 3: threshold adaptation -------------------------------------------------------
    def _end_episode(self, reason: str) -> None:
        cfg = self.dlora
        if (not cfg.adapt or self.unmerged_tps is None or self._episode_s <= 0
                or self._merged_steps < cfg.min_merge_steps):
            return
        merged_tps = self._episode_tokens / self._episode_s
        if merged_tps < self.unmerged_tps:
            self.alpha = min(1.0, self.alpha + cfg.adapt_step)
        else:
            self.alpha = max(self.beta + cfg.threshold_gap, self.alpha - cfg.adapt_step)
        if reason == "threshold" and self._episode_recent_tps is not None:
            if self._episode_recent_tps > self.unmerged_tps:
                self.beta = max(0.0, self.beta - cfg.adapt_step)
            else:
                self.beta = self.beta + cfg.adapt_step
        self.beta = min(self.beta, self.alpha - cfg.threshold_gap)
