"""The step plan being built (torch-free): one row per sequence it feeds, and the token budget
left of scheduler.max_batched_tokens. Policies read the budget and what a sequence has planned;
the scheduler adds rows and takes back those of sequences it preempts.

It never touches a sequence's pages, status or queue place: the scheduler does (base.py).
"""
from __future__ import annotations

from loraplex.daemon.scheduler.sequence import Sequence
from loraplex.ipc.engine_plan import RowPlan


class PlanDraft:
    def __init__(self) -> None:
        self.rows: dict[str, RowPlan] = {}  # by request id
        self.budget = 0  # tokens the plan may still feed

    def __bool__(self) -> bool:
        """The plan has rows."""
        return bool(self.rows)

    def start(self, budget: int) -> None:
        """A new plan, with no rows and `budget` tokens to feed."""
        self.rows = {}
        self.budget = budget

    def add(self, seq: Sequence, n: int) -> None:
        """A row feeding the next `n` tokens of `seq` (sampling when they are all it has)."""
        start = seq.num_computed
        scored, following = prompt_scoring(seq, start, n)
        self.rows[seq.request_id] = RowPlan(
            request_id=seq.request_id,
            token_ids=seq.token_slice(start, start + n),
            start_pos=start,
            kv_pages=list(seq.kv_pages),
            adapter=seq.req.adapter,
            sample=start + n == seq.num_tokens,
            sampling=seq.req.sampling,
            sample_index=len(seq.output_ids),
            prompt_scored=scored,
            prompt_next=following,
        )
        self.budget -= n

    def take_back(self, seq: Sequence) -> int:
        """Take `seq`'s row out of the plan, giving its tokens back to the budget; returns them."""
        row = self.rows.pop(seq.request_id, None)
        if row is None:
            return 0
        self.budget += len(row.token_ids)
        return len(row.token_ids)

    def planned(self, seq: Sequence) -> int:
        """Tokens of `seq` in the plan."""
        row = self.rows.get(seq.request_id)
        return 0 if row is None else len(row.token_ids)

    def take_rows(self) -> list[RowPlan]:
        """The rows, for the StepPlan; the draft is left empty."""
        rows, self.rows = list(self.rows.values()), {}
        return rows


def prompt_scoring(seq: Sequence, start: int, n: int) -> tuple[int, int]:
    """For a row feeding tokens [start, start+n) of `seq`: how many of its leading positions score
    the prompt token after them (prompt logprobs: position p scores prompt token p+1, so positions
    up to the prompt's next-to-last do), and the prompt token after the row when its last position
    scores it (else -1). A recomputed prompt is scored again (the daemon keeps the first values)."""
    if seq.req.sampling.prompt_logprobs < 0:
        return 0, -1
    prompt = seq.req.prompt_ids
    scored = max(0, min(start + n, len(prompt) - 1) - start)
    return scored, prompt[start + n] if scored and start + n < len(prompt) else -1
