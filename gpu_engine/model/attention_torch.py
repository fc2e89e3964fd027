"""Paged attention in plain torch (the reference for the Triton kernels): per row,
gather K/V through the page table, causal (and sliding-window) SDPA with GQA."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from loraplex.gpu_engine.model.batch import ForwardBatch, RowSpan
from loraplex.gpu_engine.pool import UnifiedPool


class TorchPagedAttention:
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, sliding_window: int | None) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.sliding_window = sliding_window
        self.scale = 1.0 / math.sqrt(head_dim)

    def forward(self, q: torch.Tensor, layer: int, batch: ForwardBatch, pool: UnifiedPool) -> torch.Tensor:
        # q: [tokens, heads, head_dim] (RoPE applied; this step's K/V already written) -> same shape
        out = torch.empty_like(q)
        group = self.num_heads // self.num_kv_heads
        for row in batch.rows:
            keys, values = pool.read_kv(layer, row.pages, row.context)
            keys = keys.view(row.context, self.num_kv_heads, self.head_dim).repeat_interleave(group, dim=1)
            values = values.view(row.context, self.num_kv_heads, self.head_dim).repeat_interleave(group, dim=1)
            rows = slice(row.first, row.first + row.count)
            o = F.scaled_dot_product_attention(
                q[rows].transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1),
                attn_mask=self._mask(row, q.device), scale=self.scale,
            )  # [heads, count, head_dim]
            out[rows] = o.transpose(0, 1)
        return out

    def _mask(self, row: RowSpan, device: torch.device) -> torch.Tensor | None:
        window = self.sliding_window
        if row.count == 1 and (window is None or row.context <= window):
            return None  # a decode token sees its whole context
        q_pos = torch.arange(row.start_pos, row.start_pos + row.count, device=device)[:, None]
        k_pos = torch.arange(row.context, device=device)[None, :]
        mask = k_pos <= q_pos
        if window is not None:
            mask &= (q_pos - k_pos) < window
        return mask
