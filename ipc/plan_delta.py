"""Incremental step plans: what travels to an engine instead of a whole StepPlan.

The engine keeps a persistent batch: for each row of the last plan it ran, its page table,
adapter and sampling. A StepDelta then carries only what changed: a row the engine does not
know (new, or back after leaving the batch) comes with its whole page table, adapter and
SamplingSpec; a row it knows comes with its tokens, position and the pages appended since.
A row absent from a delta leaves the engine's batch (finished, preempted, moved, or not
planned this step): both sides forget it, so the next plan sends it whole. A resync delta
(`resync=True`: the first after an engine (re)start or a refused step) sends every row whole
and the engine forgets the rest first. A decode step's delta thus grows with the batch, not
with batch x context.

PlanEncoder is the daemon's side (one per engine), PlanBook the engine's; both torch-free
and plain data, so the same objects travel as msgpack maps.

With one step planned ahead (scheduler.overlap) the daemon plans a decode row before it
knows the token the row sampled in the step still running: the row's token is FEED_SAMPLED,
and the engine feeds the token it sampled for that row last (`sampled` records them, `feed`
puts them in). `expand` may run on the engine's socket thread while the step before runs
(ipc/order_pump.py), `feed` on its executing thread just before the step: a page table a
plan holds is never changed afterwards (a row's table grows into a new list).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from loraplex.ipc.engine_plan import (
    AdapterPlacement,
    CpuAssistStep,
    GrammarOrder,
    RowPlan,
    SamplingSpec,
    StepPlan,
    StepResult,
)

FEED_SAMPLED = -1  # a token id meaning "the token this engine sampled for this row in its last step"


@dataclass(frozen=True, slots=True)
class RowDelta:
    """One row of a StepDelta. `pages`: a new row's whole page table, else the pages appended
    since its last plan; `adapter` and `sampling` are set (and read) for new rows only."""

    request_id: str
    token_ids: list[int]
    start_pos: int
    pages: list[int]
    sample: bool
    sample_index: int = 0
    new: bool = False
    adapter: str | None = None
    sampling: SamplingSpec | None = None
    cpu_layers: int = 0
    cpu_row: int = 0
    prompt_scored: int = 0  # RowPlan's: per step, not kept by the engine
    prompt_next: int = -1


@dataclass(frozen=True, slots=True)
class StepDelta:
    step_id: int
    rows: list[RowDelta]
    resync: bool = False  # the engine forgets every row it knows before reading this one
    place: list[AdapterPlacement] = field(default_factory=list)
    evict: list[str] = field(default_factory=list)
    cpu: CpuAssistStep | None = None
    merged_adapter: str | None = None
    grammars: list[GrammarOrder] = field(default_factory=list)  # compiled off the step (StepPlan.grammars)


@dataclass(slots=True)
class _Sent:
    """What the engine knows of a row (daemon side)."""
    next_pos: int  # where its next tokens start if it stays in the batch
    num_pages: int
    adapter: str | None


class PlanEncoder:
    """The daemon's side: turns each StepPlan into the delta against what this engine knows."""

    def __init__(self) -> None:
        self._sent: dict[str, _Sent] = {}
        self._resync = True

    def reset(self) -> None:
        """The engine's batch is unknown (it restarted, or refused a step): resynchronise."""
        self._sent = {}
        self._resync = True

    def encode(self, plan: StepPlan) -> StepDelta:
        rows: list[RowDelta] = []
        sent: dict[str, _Sent] = {}
        known = self._sent
        for row in plan.rows:
            before = known.get(row.request_id)
            # A row continues only from where its last plan left it, with the same adapter; a
            # row preempted and readmitted restarts at position 0, with new pages.
            new = before is None or before.next_pos != row.start_pos or before.adapter != row.adapter
            pages = row.kv_pages
            if new:
                rows.append(RowDelta(row.request_id, row.token_ids, row.start_pos, list(pages), row.sample,
                                     row.sample_index, True, row.adapter, row.sampling, row.cpu_layers, row.cpu_row,
                                     row.prompt_scored, row.prompt_next))
            else:
                rows.append(RowDelta(row.request_id, row.token_ids, row.start_pos, pages[before.num_pages:],
                                     row.sample, row.sample_index, cpu_layers=row.cpu_layers, cpu_row=row.cpu_row,
                                     prompt_scored=row.prompt_scored, prompt_next=row.prompt_next))
            sent[row.request_id] = _Sent(row.start_pos + len(row.token_ids), len(pages), row.adapter)
        delta = StepDelta(plan.step_id, rows, self._resync, plan.place, plan.evict, plan.cpu, plan.merged_adapter,
                          plan.grammars)
        self._sent, self._resync = sent, False
        return delta


@dataclass(slots=True)
class _Row:
    """A row of the engine's persistent batch."""
    pages: list[int]
    adapter: str | None
    sampling: SamplingSpec
    next_pos: int


class PlanBook:
    """The engine's side: the persistent batch, and each delta expanded back into a StepPlan."""

    def __init__(self) -> None:
        self.rows: dict[str, _Row] = {}
        self.last_sampled: dict[str, int] = {}  # request id -> the token its row sampled in the last step
        self.dropped: list[str] = []  # rows the last expanded delta left out (the engine forgets their state)

    def sampled(self, result: StepResult) -> None:
        """The step ran: its sampled tokens are what FEED_SAMPLED means in the next one."""
        self.last_sampled = {r.request_id: r.token_id for r in result.rows}

    def failed(self) -> None:
        """The step failed: nothing it planned ran, so the next step must resync (the rows it
        knew stay known to the sampler until the resync says which went)."""
        self.rows, self.last_sampled = {}, {}

    def expand(self, delta: StepDelta) -> StepPlan:
        """The StepPlan `delta` stands for; ValueError (and an empty batch: the daemon resyncs)
        when it refers to a row this engine does not know or does not continue one."""
        try:
            return self._expand(delta)
        except ValueError:
            self.failed()
            raise

    def _expand(self, delta: StepDelta) -> StepPlan:
        known = {} if delta.resync else self.rows
        batch: dict[str, _Row] = {}
        rows: list[RowPlan] = []
        for d in delta.rows:
            if d.new:
                if d.sampling is None:
                    raise ValueError(f"new row {d.request_id} came without its sampling")
                row = _Row(list(d.pages), d.adapter, d.sampling, 0)
            else:
                row = known.get(d.request_id)
                if row is None:
                    raise ValueError(f"row {d.request_id} is not in this engine's batch (resync needed)")
                if row.next_pos != d.start_pos:
                    raise ValueError(f"row {d.request_id} continues at {d.start_pos}, not {row.next_pos}")
                if d.pages:
                    row.pages = row.pages + d.pages  # the last plan's table may still be in use
            if d.request_id in batch:
                raise ValueError(f"row {d.request_id} appears twice in step {delta.step_id}")
            row.next_pos = d.start_pos + len(d.token_ids)
            batch[d.request_id] = row
            rows.append(RowPlan(d.request_id, d.token_ids, d.start_pos, row.pages, row.adapter, d.sample,
                                row.sampling, d.sample_index, d.cpu_layers, d.cpu_row, d.prompt_scored, d.prompt_next))
        self.dropped = [request_id for request_id in self.rows if request_id not in batch]
        self.rows = batch
        return StepPlan(delta.step_id, rows, delta.place, delta.evict, delta.cpu, delta.merged_adapter,
                        delta.grammars)

    def feed(self, plan: StepPlan) -> StepPlan:
        """`plan` (expanded here, so the engine's own) with each FEED_SAMPLED token replaced, in
        place, by the token its row sampled in the last step; ValueError when that step did not
        sample one for it (it failed, or never ran). In place: this runs between two steps."""
        last_sampled = self.last_sampled
        for row in plan.rows:
            tokens = row.token_ids
            if FEED_SAMPLED not in tokens:
                continue
            last = last_sampled.get(row.request_id)
            if last is None or tokens.count(FEED_SAMPLED) > 1:
                raise ValueError(f"row {row.request_id} feeds a token its last step did not sample")
            tokens[tokens.index(FEED_SAMPLED)] = last
        return plan
