"""Prompt logprobs (vLLM's prompt_logprobs): which positions of a step score which prompt token,
and the scoring itself, in bounded chunks of rows.

A row asking for them (RowPlan.prompt_scored) has the final hidden states of those positions
kept by the forward; here they go through the LM head and log_softmax a chunk of rows at a time
(at most MAX_CHUNK_ELEMS logits live at once, whatever the prompt's length), and each scored
token's logprob, rank and top-k alternatives come back as plain lists, one transfer per step.
Never samples; never touches the pool.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from loraplex.ipc.engine_plan import PromptLogprobChunk, RowPlan

# Logits (float32 elements) one chunk of scored rows may hold: 16 MiB, plus log_softmax's copy.
MAX_CHUNK_ELEMS = 1 << 22
# A logprob that is not finite (the model's numbers overflowed) is reported as this floor: the
# wire carries finite floats only.
LOGPROB_FLOOR = -1e4


@dataclass(frozen=True, slots=True)
class ScoredRow:
    """A row's scored positions: tokens[first:first+count] of the step, scoring prompt tokens
    start_pos+1 .. start_pos+count with `k` alternatives each."""

    request_id: str
    first: int
    count: int
    start_pos: int
    k: int


def scored_positions(row: RowPlan, first: int) -> tuple[ScoredRow, list[int]] | None:
    """The row's scored positions (None when it scores none) and their target tokens; `first`:
    the row's first token in the step. ValueError when the plan is inconsistent."""
    n = row.prompt_scored
    if n <= 0:
        return None
    if n > len(row.token_ids) or row.sampling.prompt_logprobs < 0:
        raise ValueError(f"row {row.request_id}: {n} scored positions in a row of {len(row.token_ids)} tokens "
                         f"(prompt_logprobs {row.sampling.prompt_logprobs})")
    targets = list(row.token_ids[1:n + 1])
    if len(targets) < n:  # the last scored position is the row's last token: its target comes next
        if row.prompt_next < 0:
            raise ValueError(f"row {row.request_id}: its last scored position has no next prompt token")
        targets.append(row.prompt_next)
    return ScoredRow(row.request_id, first, n, row.start_pos, row.sampling.prompt_logprobs), targets


@torch.inference_mode()
def score(logits_of: Callable[[torch.Tensor, int], torch.Tensor | None], hidden: torch.Tensor, targets: torch.Tensor,
          rows: list[ScoredRow], vocab_size: int, *, chunk_rows: int | None = None) -> list[PromptLogprobChunk]:
    """hidden: [P, hidden] final (normed) states of the scored positions, rows in order; targets:
    [P] int64, the prompt token each scores. logits_of maps a chunk of states and the index of its
    first row in `hidden` (LoRA on the LM head differs per row) to float32 logits [c, vocab_size]
    (None on a tensor-parallel rank that does not sample: it still joins each chunk's collective,
    so every rank cuts the same chunks, and gets no result). chunk_rows: rows per chunk (default:
    as many as MAX_CHUNK_ELEMS logits hold)."""
    total = hidden.shape[0]
    if total == 0 or not rows:
        return []
    step = chunk_rows or max(1, MAX_CHUNK_ELEMS // max(1, vocab_size))
    k = max(r.k for r in rows)
    logprobs, ranks, top_values, top_ids = [], [], [], []
    for start in range(0, total, step):
        logits = logits_of(hidden[start:start + step], start)  # [c, vocab] float32
        if logits is None:
            continue
        logp = torch.log_softmax(logits, dim=-1)
        picked = logp.gather(1, targets[start:start + step, None])  # [c, 1]
        ranks.append((logp > picked).sum(dim=-1) + 1)
        logprobs.append(picked[:, 0])
        if k:
            values, ids = torch.topk(logp, min(k, logp.shape[1]), dim=-1)
            top_values.append(values)
            top_ids.append(ids)
        del logits, logp
    if not logprobs:
        return []
    lp = torch.nan_to_num(torch.cat(logprobs), nan=LOGPROB_FLOOR, neginf=LOGPROB_FLOOR).clamp_min(LOGPROB_FLOOR)
    lp_list, rank_list = lp.tolist(), torch.cat(ranks).tolist()
    tv = torch.nan_to_num(torch.cat(top_values), nan=LOGPROB_FLOOR, neginf=LOGPROB_FLOOR).clamp_min(
        LOGPROB_FLOOR).tolist() if k else []
    ti = torch.cat(top_ids).tolist() if k else []
    out = []
    at = 0
    for row in rows:
        end = at + row.count
        out.append(PromptLogprobChunk(
            request_id=row.request_id, first=row.start_pos + 1, logprobs=lp_list[at:end], ranks=rank_list[at:end],
            top_ids=[ids[:row.k] for ids in ti[at:end]] if row.k else [],
            top_logprobs=[values[:row.k] for values in tv[at:end]] if row.k else []))
        at = end
    return out
