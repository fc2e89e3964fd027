"""Incremental step plans: every delta, through the real codec, expands on the engine's side
into exactly the plan the daemon made, over random runs of rows joining, growing, leaving,
coming back and being preempted; a decode step's delta grows with the batch, not its context."""
from __future__ import annotations

import random

import pytest

from loraplex.ipc.codec import decode, encode
from loraplex.ipc.engine_plan import RowPlan, RowResult, SamplingSpec, StepPlan, StepResult
from loraplex.ipc.plan_delta import FEED_SAMPLED, PlanBook, PlanEncoder
from loraplex.ipc.protocol import EngineStep, EngineStepDelta


def wire(encoder: PlanEncoder, plan: StepPlan):
    return decode(encode(EngineStepDelta(delta=encoder.encode(plan)))).delta


class FakeRow:
    """A sequence as the scheduler sees it: position, pages, adapter, sampling."""

    def __init__(self, rng: random.Random, rid: str, free: list[int]) -> None:
        self.rid, self.rng, self.free = rid, rng, free
        self.adapter = rng.choice([None, "a", "b"])
        self.sampling = SamplingSpec(temperature=rng.random(), seed=rng.randrange(1 << 30))
        self.restart()

    def restart(self) -> None:  # admitted, or preempted and readmitted: recompute from 0, new pages
        self.pos, self.sampled = 0, 0
        self.pages = [self.free.pop() for _ in range(self.rng.randint(1, 3))]
        self.prompt = self.rng.randint(1, 40)

    def row(self) -> RowPlan:
        n = min(self.rng.randint(1, 16), self.prompt - self.pos) if self.pos < self.prompt else 1
        if self.rng.random() < 0.3:
            self.pages.append(self.free.pop())
        row = RowPlan(self.rid, [self.rng.randrange(500) for _ in range(n)], self.pos, list(self.pages),
                      self.adapter, self.pos + n >= self.prompt, self.sampling, self.sampled)
        self.pos += n
        self.sampled += row.sample
        return row


@pytest.mark.parametrize("seed", range(6))
def test_every_delta_expands_into_the_plan_it_stands_for(seed: int) -> None:
    rng = random.Random(seed * 7919 + 17)
    free = list(range(100_000))
    rng.shuffle(free)
    encoder, book = PlanEncoder(), PlanBook()
    live = {f"r{i}": FakeRow(rng, f"r{i}", free) for i in range(rng.randint(1, 12))}
    for step in range(80):
        if rng.random() < 0.2:  # a new request
            rid = f"r{len(live) + step * 100}"
            live[rid] = FakeRow(rng, rid, free)
        for seq in list(live.values()):
            if rng.random() < 0.05:
                del live[seq.rid]  # finished, cancelled or moved away
            elif rng.random() < 0.05:
                seq.restart()  # preempted (maybe readmitted in this very step)
        planned = [s for s in live.values() if rng.random() < 0.85]  # some rows sit a step out
        skipped = [s for s in live.values() if s not in planned]
        for seq in skipped:
            if rng.random() < 0.5:
                seq.restart()  # left the batch and came back later from the start
        plan = StepPlan(step, [s.row() for s in planned])
        if rng.random() < 0.05:
            encoder.reset()  # the engine restarted: a fresh book on its side
            book = PlanBook()
        assert book.expand(wire(encoder, plan)) == plan


def test_an_unknown_row_is_refused_and_the_next_delta_resyncs() -> None:
    rng = random.Random(3)
    sampling = SamplingSpec(seed=rng.randrange(1000))
    first = StepPlan(1, [RowPlan("x", [rng.randrange(500)] * 4, 0, [rng.randrange(900)], None, True, sampling)])
    encoder, book = PlanEncoder(), PlanBook()
    book.expand(wire(encoder, first))
    second = StepPlan(2, [RowPlan("x", [7], 4, first.rows[0].kv_pages, None, True, sampling, 1)])
    with pytest.raises(ValueError, match="not in this engine's batch"):
        PlanBook().expand(wire(encoder, second))  # an engine that never saw step 1
    encoder.reset()  # what the daemon does when a step is refused
    delta = wire(encoder, second)
    assert delta.resync and delta.rows[0].new and delta.rows[0].sampling == sampling
    assert PlanBook().expand(delta) == second


def test_a_decode_delta_grows_with_the_batch_not_the_context() -> None:
    rng = random.Random(11)

    def decode_bytes(batch: int, context: int) -> tuple[int, int]:
        free = rng.sample(range(1 << 20), batch * (context // 16 + 2))
        rows = []
        for i in range(batch):
            pages = [free.pop() for _ in range(context // 16 + 1)]
            rows.append(RowPlan(f"req-{i}", [rng.randrange(500)], context, pages, rng.choice([None, "a"]), True,
                                SamplingSpec(seed=rng.randrange(1000)), 5))
        encoder = PlanEncoder()
        encoder.encode(StepPlan(1, [RowPlan(r.request_id, r.token_ids, r.start_pos - 1, r.kv_pages, r.adapter, True,
                                            r.sampling, 4) for r in rows]))
        plan = StepPlan(2, rows)
        return len(encode(EngineStepDelta(delta=encoder.encode(plan)))), len(encode(EngineStep(plan=plan)))

    small, small_full = decode_bytes(64, 256)
    long_ctx, long_full = decode_bytes(64, 4096)
    wide, _ = decode_bytes(256, 4096)
    # whole tables grow with the context (a page id a row each 16 tokens)...
    assert long_full - small_full > 64 * (4096 - 256) // 16
    assert long_ctx < 1.1 * small  # ...a delta does not
    assert 3 * small < wide < 5 * small  # and it grows with the batch


def test_a_fed_row_gets_the_token_its_last_step_sampled_and_old_tables_never_change() -> None:
    rng = random.Random(23)
    sampling = SamplingSpec(seed=rng.randrange(1000))
    pages = [rng.randrange(900) for _ in range(2)]
    encoder, book = PlanEncoder(), PlanBook()
    first = book.feed(book.expand(wire(encoder,
                                       StepPlan(1, [RowPlan("x", [4, 9, 7], 0, pages, None, True, sampling)]))))
    token = rng.randrange(3, 500)
    book.sampled(StepResult(1, [RowResult("x", token, None)]))
    grown = pages + [rng.randrange(900, 1800)]
    second = StepPlan(2, [RowPlan("x", [FEED_SAMPLED], 3, grown, None, True, sampling, 1)])
    ahead = book.expand(wire(encoder, second))
    assert first.rows[0].kv_pages == pages  # the table step 1 ran with is left as it was
    assert book.feed(ahead).rows[0].token_ids == [token] and ahead.rows[0].kv_pages == grown
    book.failed()  # that step failed: nothing it sampled can be fed
    encoder.reset()
    with pytest.raises(ValueError, match="did not sample"):
        book.feed(book.expand(wire(encoder, second)))


def test_rows_left_out_are_reported_dropped_so_the_engine_forgets_their_sampling_state() -> None:
    rng = random.Random(31)
    spec = SamplingSpec(seed=rng.randrange(1000), repetition_penalty=1.2)
    encoder, book = PlanEncoder(), PlanBook()
    rows = [RowPlan(f"r{i}", [rng.randrange(500)], 0, [rng.randrange(900)], None, True, spec, 0) for i in range(3)]
    book.expand(decode(encode(EngineStepDelta(delta=encoder.encode(StepPlan(1, rows))))).delta)
    assert book.dropped == []
    kept = [RowPlan(r.request_id, [FEED_SAMPLED], 1, r.kv_pages, None, True, spec, 1) for r in rows[1:]]
    book.expand(decode(encode(EngineStepDelta(delta=encoder.encode(StepPlan(2, kept))))).delta)
    assert book.dropped == ["r0"]

    from loraplex.gpu_engine.sampler import Sampler

    sampler = Sampler(500)
    for r in rows:
        sampler.history.feed(r)
    sampler.forget(book.dropped)
    assert len(sampler.history) == 2
