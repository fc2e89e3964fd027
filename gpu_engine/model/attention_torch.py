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
        window = self.windows[layer]
        for row in batch.rows:
            self._row(q, out, row, layer, window, pool)
        return out

    def _row(self, q: torch.Tensor, out: torch.Tensor, row: RowSpan, layer: int, window: int | None,
             pool: UnifiedPool) -> None:
        """out[row's tokens] = their attention over the row's keys."""
        group = self.num_heads // self.num_kv_heads
        # no page before the window of the row's first query is read: it may be back in the pool
        first_key = 0 if window is None else max(0, row.start_pos - window + 1)
        keys, values = pool.read_kv(layer, row.pages, row.context, first_key)
        mask = self._mask(row, window, q.device)
        if mask is None:  # one query over its whole context: a decode row
            out[row.first] = self._decode(q[row.first], keys, values, row.context)
            return
        keys = keys.view(row.context, self.num_kv_heads, self.head_dim)
        values = values.view(row.context, self.num_kv_heads, self.head_dim)
        rows = slice(row.first, row.first + row.count)
        q_rows = q[rows].transpose(0, 1)
        if self.softcap is None:  # SDPA shares each KV head with its group of query heads itself
            o = F.scaled_dot_product_attention(q_rows, keys.transpose(0, 1), values.transpose(0, 1), attn_mask=mask,
                                               scale=self.scale, enable_gqa=group > 1)
        else:
            k_rows = keys.repeat_interleave(group, dim=1).transpose(0, 1)
            v_rows = values.repeat_interleave(group, dim=1).transpose(0, 1)
            o = self._capped(q_rows, k_rows, v_rows, mask)
        out[rows] = o.transpose(0, 1)  # o: [heads, count, head_dim]

    def _decode(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, context: int) -> torch.Tensor:
        """One query [heads, head_dim] over `context` keys and values [context, kv_dim]: the heads of
        one KV head share it as a group (no copy of K and V per head, as repeat_interleave makes)."""
        kv_heads, head_dim = self.num_kv_heads, self.head_dim
        grouped = q.view(kv_heads, self.num_heads // kv_heads, head_dim)
        k = keys.view(context, kv_heads, head_dim).transpose(0, 1)  # [kvh, context, hd]
        v = values.view(context, kv_heads, head_dim).transpose(0, 1)
        logits = torch.matmul(grouped, k.transpose(1, 2)) * self.scale  # [kvh, group, context]
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        probs = torch.softmax(logits.float(), dim=-1).to(q.dtype)
        return torch.matmul(probs, v).view(self.num_heads, head_dim)

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
