"""Paged attention through the Triton kernels (same `forward` contract as
`TorchPagedAttention`): rows with one query token go to the flash-decoding
kernel, longer rows (prefill chunks) to the causal prefill kernel; both read
K/V straight from the unified pool through each row's page table, within each
layer's sliding window, with the model's q·k scale and tanh logit soft-cap.

Row metadata is built once per step (the same ForwardBatch serves every layer),
or comes prebuilt in static buffers (`ForwardBatch.decode_rows`) under CUDA-graph replay.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from loraplex.gpu_engine.model.batch import ForwardBatch, RowSpan
from loraplex.gpu_engine.model.config import ModelConfig
from loraplex.gpu_engine.pool import UnifiedPool
from loraplex.kernels.paged_kv import PagedRows, build_rows
from loraplex.kernels.runtime import require_triton

DEFAULT_SPLIT_TOKENS = 256  # keys per flash-decoding split


@dataclass(slots=True)
class _StepRows:
    batch: ForwardBatch  # held, so `is` on the next call cannot match a recycled object
    prefill: PagedRows | None  # rows with more than one query token
    decode: PagedRows | None  # rows with one query token


class TritonPagedAttention:
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, windows: Sequence[int | None], *,
                 scale: float | None = None, softcap: float | None = None,
                 split_tokens: int = DEFAULT_SPLIT_TOKENS) -> None:
        if num_kv_heads <= 0 or num_heads % num_kv_heads:
            raise ValueError(f"num_heads={num_heads} must be a multiple of num_kv_heads={num_kv_heads}")
        require_triton()
        from loraplex.kernels import paged_attention_decode, paged_attention_prefill  # after the check above

        self._decode, self._prefill = paged_attention_decode, paged_attention_prefill
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.windows = tuple(windows)  # per layer; None: the whole context
        self.scale = scale if scale is not None else 1.0 / math.sqrt(head_dim)
        if softcap is not None and (not math.isfinite(softcap) or softcap < 0):
            raise ValueError(f"softcap must be a positive float, 0 or None (off), got {softcap}")
        self.softcap = softcap or None  # tanh soft-capping of the logits (Gemma 2); 0 is off
        self.split_tokens = split_tokens
        self._step: _StepRows | None = None

    @classmethod
    def for_config(cls, cfg: ModelConfig) -> TritonPagedAttention:
        return cls(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.layer_windows, scale=cfg.attention_scale,
                   softcap=cfg.attn_softcap)

    def forward(self, q: torch.Tensor, layer: int, batch: ForwardBatch, pool: UnifiedPool) -> torch.Tensor:
        # q: [tokens, heads, head_dim] (RoPE applied; this step's K/V already written) -> same shape
        q = q if q.stride(-1) == 1 else q.contiguous()
        rows = self._rows(batch, q.device)
        kv = pool.data[layer]  # [num_pages, page_elems] = [pages, page_tokens, 2, kv_dim] flattened
        out = torch.empty_like(q)
        common = dict(num_kv_heads=self.num_kv_heads, page_tokens=pool.geometry.page_tokens,
                      window=self.windows[layer], scale=self.scale, softcap=self.softcap, out=out)
        if rows.prefill is not None:
            self._prefill.paged_prefill_attention(q, kv, rows.prefill, **common)
        if rows.decode is not None:
            self._decode.paged_decode_attention(q, kv, rows.decode, split_tokens=self.split_tokens, **common)
        return out

    def _rows(self, batch: ForwardBatch, device: torch.device) -> _StepRows:
        if self._step is not None and self._step.batch is batch:
            return self._step
        if batch.decode_rows is not None:  # static: no host work, nothing read back from the device
            self._step = _StepRows(batch, None, batch.decode_rows)
            return self._step
        prefill = [r for r in batch.rows if r.count > 1]
        decode = [r for r in batch.rows if r.count == 1]
        self._step = _StepRows(batch, self._build(prefill, device), self._build(decode, device))
        return self._step

    @staticmethod
    def _build(spans: list[RowSpan], device: torch.device) -> PagedRows | None:
        if not spans:
            return None
        flat = torch.cat([s.pages for s in spans]).tolist()  # one device read per step, not per layer
        ends = torch.tensor([len(s.pages) for s in spans]).cumsum(0).tolist()
        pages = [flat[end - len(s.pages): end] for s, end in zip(spans, ends)]
        return build_rows([(s.first, s.count, s.start_pos, p) for s, p in zip(spans, pages)], device)
