"""Row metadata the paged-attention kernels read, its checks, and the torch
reference both kernels must equal.

One layer's KV lives in the unified pool as `kv[page, slot, 2, kv_heads, head_dim]`
(flat `[num_pages, page_elems]`); a row's key at position p sits in page
`page_table[row, p // page_tokens]`, slot `p % page_tokens`. Launches nothing.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from loraplex.kernels.runtime import FLOAT_DTYPES, INDEX_DTYPES, check_contiguous, check_tensor

LOG2E = 1.4426950408889634  # the kernels' softmax runs in log2 units (exp2)


@dataclass(frozen=True, slots=True)
class PagedRows:
    """Sequences of one step: query tokens q_start..+q_len at positions start_pos.., attending
    causally to keys 0..context-1 (context = start_pos + q_len). Dead rows have q_len 0."""

    q_start: torch.Tensor  # [R] int32
    q_len: torch.Tensor  # [R] int32
    start_pos: torch.Tensor  # [R] int32
    context: torch.Tensor  # [R] int32
    page_table: torch.Tensor  # [R, max_pages] int32
    max_q_len: int  # grid capacity: >= every q_len
    max_context: int  # grid capacity: >= every context

    @property
    def num_rows(self) -> int:
        return int(self.q_start.shape[0])

    def check(self) -> None:
        rows = self.num_rows
        for name in ("q_start", "q_len", "start_pos", "context"):
            t = getattr(self, name)
            check_tensor(f"rows.{name}", t, ndim=1, dtypes=INDEX_DTYPES, shape=(rows,))
            check_contiguous(f"rows.{name}", t)
        check_tensor("rows.page_table", self.page_table, ndim=2, dtypes=INDEX_DTYPES, shape=(rows, None))
        check_contiguous("rows.page_table", self.page_table)
        if self.max_q_len < 0 or self.max_context < 0:
            raise ValueError("max_q_len and max_context must be >= 0")


def build_rows(spans: Sequence[tuple[int, int, int, Sequence[int]]], device: torch.device | str, *,
               capacity_rows: int | None = None, max_q_len: int | None = None,
               max_context: int | None = None) -> PagedRows:
    """spans: (q_start, q_len, start_pos, pages) per row; padded to capacity_rows dead rows."""
    rows = max(capacity_rows or 0, len(spans))
    width = max([1] + [len(s[3]) for s in spans])
    dead = rows - len(spans)
    ints = torch.tensor([[s[0] for s in spans] + [0] * dead, [s[1] for s in spans] + [0] * dead,
                         [s[2] for s in spans] + [0] * dead, [s[1] + s[2] for s in spans] + [0] * dead],
                        dtype=torch.int32).to(device)
    table = torch.tensor([list(s[3]) + [0] * (width - len(s[3])) for s in spans] + [[0] * width] * dead,
                         dtype=torch.int32).to(device)
    live_q = max([0] + [s[1] for s in spans])
    live_ctx = max([0] + [s[1] + s[2] for s in spans])
    return PagedRows(ints[0], ints[1], ints[2], ints[3], table, max(max_q_len or 0, live_q),
                     max(max_context or 0, live_ctx))


def check_attention_args(q: torch.Tensor, kv: torch.Tensor, rows: PagedRows, num_kv_heads: int,
                         page_tokens: int) -> tuple[int, int, int]:
    """q: [T, H, D], kv: [num_pages, page_tokens * 2 * num_kv_heads * D] -> (H, D, group)."""
    check_tensor("q", q, ndim=3, dtypes=FLOAT_DTYPES)
    _, heads, head_dim = q.shape
    if num_kv_heads <= 0 or heads % num_kv_heads:
        raise ValueError(f"{heads} query heads are not a multiple of num_kv_heads={num_kv_heads}")
    elems = page_tokens * 2 * num_kv_heads * head_dim
    check_tensor("kv", kv, ndim=2, dtypes=(q.dtype,), shape=(None, elems))
    check_contiguous("kv", kv)
    rows.check()
    return heads, head_dim, heads // num_kv_heads


def logit_scales(scale: float, softcap: float | None) -> tuple[float, float, bool]:
    """The kernels' (qk_scale, cap_log2, SOFTCAP) for a q·k `scale` and a tanh logit soft-cap
    (None or 0: none). The kernels work in log2 units: without a cap, qk_scale = scale·log2(e);
    with one, tanh applies to natural-unit logits first, so qk_scale = 2·log2(e)·scale/softcap
    (the exp2 argument of tanh's exponential form) and cap_log2 = softcap·log2(e)."""
    if softcap is None or softcap == 0:
        return scale * LOG2E, 0.0, False
    if not math.isfinite(softcap) or softcap < 0:
        raise ValueError(f"softcap must be a positive float, 0 or None (off), got {softcap}")
    return 2.0 * LOG2E * scale / softcap, softcap * LOG2E, True


def paged_attention_reference(q: torch.Tensor, kv: torch.Tensor, rows: PagedRows, num_kv_heads: int,
                              page_tokens: int, window: int | None = None,
                              scale: float | None = None, softcap: float | None = None) -> torch.Tensor:
    """Per row: gather K/V through the page table, causal (+ window) softmax attention, GQA,
    logits soft-capped to softcap·tanh(logits / softcap) when softcap is set (Gemma 2)."""
    tokens, heads, head_dim = q.shape
    scale = scale if scale is not None else 1.0 / math.sqrt(head_dim)
    entries = kv.view(kv.shape[0], page_tokens, 2, num_kv_heads, head_dim)
    out = torch.zeros_like(q)
    group = heads // num_kv_heads
    for r in range(rows.num_rows):
        first, count, start, ctx = (int(rows.q_start[r]), int(rows.q_len[r]), int(rows.start_pos[r]),
                                    int(rows.context[r]))
        if count == 0:
            continue
        pages = rows.page_table[r, : -(-ctx // page_tokens)].long()
        keys = entries[pages].flatten(0, 1)[:ctx].float()  # [ctx, 2, kvh, D]
        k = keys[:, 0].repeat_interleave(group, dim=1)  # [ctx, H, D]
        v = keys[:, 1].repeat_interleave(group, dim=1)
        qr = q[first: first + count].float()  # [count, H, D]
        s = torch.einsum("qhd,khd->hqk", qr, k) * scale
        if softcap:
            s = torch.tanh(s / softcap) * softcap
        q_pos = torch.arange(start, start + count, device=q.device)[:, None]
        k_pos = torch.arange(ctx, device=q.device)[None, :]
        allowed = k_pos <= q_pos
        if window is not None:
            allowed &= (q_pos - k_pos) < window
        s = s.masked_fill(~allowed, float("-inf"))
        out[first: first + count] = torch.einsum("hqk,khd->qhd", s.softmax(-1), v).to(q.dtype)
    return out
