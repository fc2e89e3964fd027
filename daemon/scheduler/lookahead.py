"""The steps in flight on an engine (torch-free): the plan whose result the scheduler awaits,
the tokens each of its rows feeds, and with one step planned ahead (scheduler.overlap) the plans
launched on the engine whose results have not come back, and what the scheduler assumed of them.

Launching a plan advances its sequences as if it had run: the tokens it feeds count as
computed, and each row that samples gets a PENDING output token, which the next plan feeds
(the engine puts there the token it sampled for that row, ipc/plan_delta.py). When the
result comes, the sampled token replaces the placeholder. A failed step takes back what
every launched plan assumed (`rollback`), after which the same tokens are planned again, as
after a failed step without overlap (`InFlight.discard`).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from loraplex.daemon.scheduler.sequence import SeqStatus, Sequence
from loraplex.ipc.engine_plan import RowResult, StepPlan, StepResult
from loraplex.ipc.plan_delta import FEED_SAMPLED

# An output token sampled by a launched step, not known here yet; fed to the engine as is, it
# means "the token you sampled for this row".
PENDING = FEED_SAMPLED


@dataclass(slots=True)
class _Launched:
    plan: StepPlan
    # Per row this plan advanced: the sequence, tokens fed, the output index it samples into
    # (-1: none), and its preemption count then (a preempted sequence's count restarted).
    rows: list[tuple[Sequence, int, int, int]]


def awaits_token(seq: Sequence) -> bool:
    """The sequence's last output is still PENDING: it cannot be recomputed or moved yet."""
    return bool(seq.output_ids) and seq.output_ids[-1] == PENDING


class LaunchedSteps:
    def __init__(self) -> None:
        self._queue: deque[_Launched] = deque()
        # id(sequence) -> its preemption count when launched -> tokens the launched plans fed it; kept with
        # the queue so that `unsettled` is one lookup, not a walk over every launched row (B² a step).
        # The queue holds each counted sequence, so its id is not reused while counted.
        self._fed: dict[int, dict[int, int]] = {}

    def _count(self, rows: list[tuple[Sequence, int, int, int]], sign: int) -> None:
        for seq, n, _, preemptions in rows:
            per = self._fed.setdefault(id(seq), {})
            left = per.get(preemptions, 0) + sign * n
            if left:
                per[preemptions] = left
            else:
                per.pop(preemptions, None)
                if not per:
                    del self._fed[id(seq)]

    def __len__(self) -> int:
        return len(self._queue)

    def holds(self, request_id: str) -> bool:
        """A launched plan has a row of this request (it cannot be handed to another engine yet)."""
        return any(seq.request_id == request_id for launched in self._queue for seq, *_ in launched.rows)

    def launch(self, plan: StepPlan, fed: dict[str, int], by_id: dict[str, Sequence]) -> None:
        """`plan` went to the engine: advance its sequences by what it feeds."""
        rows = []
        for row in plan.rows:
            seq, n = by_id.get(row.request_id), fed.get(row.request_id)
            if seq is None or n is None or seq.status is not SeqStatus.RUNNING:
                continue
            seq.num_computed += n
            index = -1
            if row.sample:
                index = len(seq.output_ids)
                seq.output_ids.append(PENDING)
                seq.logprobs.append(None)
            rows.append((seq, n, index, seq.num_preemptions))
        self._queue.append(_Launched(plan, rows))
        self._count(rows, 1)

    def unsettled(self, seq: Sequence) -> int:
        """Tokens of `seq` that launched plans count as computed before their results came (a
        rollback takes them back; their steps may still be reading its KV)."""
        return self._fed.get(id(seq), {}).get(seq.num_preemptions, 0)

    def take(self, plan: StepPlan) -> list[tuple[Sequence, int, int]]:
        """The oldest launched plan, whose result came: (sequence, output index, its preemptions
        when launched) per sampling row."""
        if not self._queue or self._queue[0].plan.step_id != plan.step_id:
            raise ValueError(f"result of step {plan.step_id} is not the oldest launched step")
        rows = self._queue.popleft().rows
        self._count(rows, -1)
        return [(seq, index, preemptions) for seq, _, index, preemptions in rows if index >= 0]

    def rollback(self, by_id: dict[str, Sequence]) -> None:
        """Take back every launched plan, newest first: their tokens are uncomputed again and their
        placeholders gone (the steps failed, or the engine was lost). Sequences that left this
        scheduler meanwhile (`by_id`: those it holds) are not touched."""
        self._fed.clear()
        while self._queue:
            for seq, n, index, preemptions in reversed(self._queue.pop().rows):
                if by_id.get(seq.request_id) is not seq:
                    continue
                if index >= 0 and len(seq.output_ids) == index + 1 and seq.output_ids[index] == PENDING:
                    seq.output_ids.pop()
                    seq.logprobs.pop()
                if seq.status is SeqStatus.RUNNING and seq.num_preemptions == preemptions:
                    seq.num_computed -= n


def fill_placeholder(seq: Sequence, index: int, out: RowResult | None) -> bool:
    """Put the token a launched step sampled in place of its placeholder; False when there is no
    placeholder there any more (the sequence finished or was cut short meanwhile) or no token."""
    if out is None or index >= len(seq.output_ids) or seq.output_ids[index] != PENDING:
        return False
    seq.output_ids[index] = out.token_id
    seq.logprobs[index] = out.logprob
    if out.top_ids:  # tokens resolve in order, so the list stays one entry per output token
        seq.top_logprobs.append(dict(zip(out.top_ids, out.top_logprobs)))
    return True


class InFlight:
    """The plan handed to the engine whose result is awaited (`step_id`, None: none) and the tokens
    each of its rows feeds (`fed`, filled while the plan is built); `launched`: the plans launched
    ahead of their results. Contract: at most one plan is awaited; `launch` turns it into a
    launched one, so that the next plan may be made before its result comes."""

    def __init__(self) -> None:
        self.step_id: int | None = None
        self.fed: dict[str, int] = {}  # request id -> tokens fed in the plan in flight
        self.launched = LaunchedSteps()

    @property
    def idle(self) -> bool:
        """No plan awaited and none launched: the scheduler may be switched or handed over."""
        return self.step_id is None and not len(self.launched)

    def holds(self, request_id: str) -> bool:
        """A plan in flight has a row of this request (it cannot be handed to another engine yet)."""
        return request_id in self.fed or self.launched.holds(request_id)

    def launch(self, plan: StepPlan, by_id: dict[str, Sequence]) -> None:
        """`plan` went to the engine and the next one may be made before its result comes: its
        sequences advance as if it had run; its result is resolved later (`LaunchedSteps.take`)."""
        if plan.step_id != self.step_id:
            raise ValueError(f"step {plan.step_id} is not the plan in flight ({self.step_id})")
        self.launched.launch(plan, self.fed, by_id)
        self.fed.clear()
        self.step_id = None

    def discard(self, by_id: dict[str, Sequence]) -> None:
        """The engine failed to run the plan in flight (and every launched one): nothing they
        planned was computed, so the same tokens are simply planned again (pages and adapter
        placements stay valid)."""
        self.step_id = None
        self.fed.clear()
        self.launched.rollback(by_id)

    def settle(self, plan: StepPlan, result: StepResult) -> bool:
        """`result` came for `plan`: the plan in flight (False; nothing is awaited any more) or the
        oldest launched one (True). ValueError when it answers neither."""
        launched = plan.step_id != self.step_id and len(self.launched) > 0
        if (not launched and plan.step_id != self.step_id) or result.step_id != plan.step_id:
            raise ValueError(f"result of step {result.step_id} does not match the plan in flight ({self.step_id})")
        if not launched:
            self.step_id = None
        return launched
