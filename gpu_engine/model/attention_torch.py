"""Paged attention in plain torch (the reference for the Triton kernels): per row,
gather K/V through the page table, causal (and per-layer sliding-window) attention with
GQA, optionally with tanh soft-capped logits (Gemma 2)."""
from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from loraplex.gpu_engine.model.batch import ForwardBatch, RowSpan
from loraplex.gpu_engine.model.config import ModelConfig
from loraplex.gpu_engine.pool import UnifiedPool


class TorchPagedAttention:
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, windows: Sequence[int | None], *,
                 scale: float | None = None, softcap: float | None = None) -> None:
        """windows: each layer's sliding window (None: the whole context); scale: of q·k
        (default head_dim ** -0.5); softcap: logits become softcap·tanh(logits / softcap)."""
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.windows = tuple(windows)
        self.scale = scale if scale is not None else 1.0 / math.sqrt(head_dim)
        self.softcap = softcap

    @classmethod
    def for_config(cls, cfg: ModelConfig) -> TorchPagedAttention:
        return cls(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.layer_windows, scale=cfg.attention_scale,
                   softcap=cfg.attn_softcap)

    def forward(self, q: torch.Tensor, layer: int, batch: ForwardBatch, pool: UnifiedPool) -> torch.Tensor:
        # q: [tokens, heads, head_dim] (RoPE applied; this step's K/V already written) -> same shape
        out = torch.empty_like(q)
        group = self.num_heads // self.num_kv_heads
        window = self.windows[layer]
        for row in batch.rows:
            # no page before the window of the row's first query is read: it may be back in the pool
            first_key = 0 if window is None else max(0, row.start_pos - window + 1)
            keys, values = pool.read_kv(layer, row.pages, row.context, first_key)
            keys = keys.view(row.context, self.num_kv_heads, self.head_dim).repeat_interleave(group, dim=1)
            values = values.view(row.context, self.num_kv_heads, self.head_dim).repeat_interleave(group, dim=1)
            rows = slice(row.first, row.first + row.count)
            q_rows, k_rows, v_rows = q[rows].transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1)
            mask = self._mask(row, window, q.device)
            if self.softcap is None:
                o = F.scaled_dot_product_attention(q_rows, k_rows, v_rows, attn_mask=mask, scale=self.scale)
            else:
                o = self._capped(q_rows, k_rows, v_rows, mask)
            out[rows] = o.transpose(0, 1)  # o: [heads, count, head_dim]
        return out

    def _capped(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        # As transformers' eager attention does it: scale, cap, mask, softmax in float32.
        logits = torch.matmul(q, k.transpose(-1, -2)) * self.scale
        logits = torch.tanh(logits / self.softcap) * self.softcap
        if mask is not None:
            logits = logits.masked_fill(~mask, float("-inf"))
        probs = torch.softmax(logits.float(), dim=-1).to(q.dtype)
        return torch.matmul(probs, v)

    @staticmethod
    def _mask(row: RowSpan, window: int | None, device: torch.device) -> torch.Tensor | None:
        if row.count == 1 and (window is None or row.context <= window):
            return None  # a decode token sees its whole context
        q_pos = torch.arange(row.start_pos, row.start_pos + row.count, device=device)[:, None]
        k_pos = torch.arange(row.context, device=device)[None, :]
        mask = k_pos <= q_pos
        if window is not None:
            mask &= (q_pos - k_pos) < window
        return mask
