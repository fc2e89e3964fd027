"""Llama-family forward pass (Llama, Mistral, Qwen2) over one continuous-batching
step: prefill chunks and decode tokens of many sequences flattened into one
token axis, KV read and written through the unified pool's page tables, and
unmerged LoRA on every targeted projection.

Numerics follow the reference implementation (float32 RMSNorm statistics,
rotate-half RoPE, SDPA attention) so results match transformers + PEFT.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from loraplex.gpu_engine.lora.torch_backend import LoraGroup, TorchLoraBackend
from loraplex.gpu_engine.model.config import ModelConfig
from loraplex.gpu_engine.model.rope import Rotary
from loraplex.gpu_engine.model.weights import LayerWeights, ModelWeights
from loraplex.gpu_engine.pool import UnifiedPool


@dataclass(slots=True)
class RowSpan:
    """One sequence's tokens in the flattened step: tokens[first:first+count] sit at
    positions start_pos..; after this step its KV covers `context` tokens."""

    first: int
    count: int
    start_pos: int
    context: int
    pages: torch.Tensor  # [pages] int64


@dataclass(slots=True)
class ForwardBatch:
    token_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    kv_page_ids: torch.Tensor  # [T] page receiving each token's K/V
    kv_slots: torch.Tensor  # [T] slot inside that page
    rows: list[RowSpan]
    sample_tokens: torch.Tensor  # [S] indices of tokens whose logits are needed
    lora_groups: list[LoraGroup]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


class LlamaModel:
    def __init__(self, cfg: ModelConfig, weights: ModelWeights, lora: TorchLoraBackend) -> None:
        self.cfg = cfg
        self.w = weights
        self.lora = lora
        self.rotary = Rotary(cfg, weights.embed.device)
        self.scale = 1.0 / math.sqrt(cfg.head_dim)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, pool: UnifiedPool) -> torch.Tensor:
        """Returns float32 logits [S, vocab] for the sampled tokens."""
        h = F.embedding(batch.token_ids, self.w.embed)  # [T, hidden]
        cos, sin = self.rotary.cos_sin(batch.positions, h.dtype)
        for layer_idx, layer in enumerate(self.w.layers):
            flat = pool.layer_flat(layer_idx)
            x = rms_norm(h, layer.input_norm, self.cfg.rms_norm_eps)
            attn = self._attention(layer_idx, layer, x, cos, sin, batch, pool, flat)
            h = h + self._proj(layer, "o_proj", attn, flat, batch)
            x = rms_norm(h, layer.post_norm, self.cfg.rms_norm_eps)
            gate = self._proj(layer, "gate_proj", x, flat, batch)
            up = self._proj(layer, "up_proj", x, flat, batch)
            h = h + self._proj(layer, "down_proj", F.silu(gate) * up, flat, batch)
        last = rms_norm(h.index_select(0, batch.sample_tokens), self.w.norm, self.cfg.rms_norm_eps)
        return F.linear(last, self.w.lm_head).float()

    def _proj(self, layer: LayerWeights, name: str, x: torch.Tensor, flat: torch.Tensor,
              batch: ForwardBatch) -> torch.Tensor:
        out = F.linear(x, layer.proj[name], layer.bias.get(name))
        if batch.lora_groups:
            self.lora.apply(out, x, flat, name, batch.lora_groups)
        return out

    def _attention(self, layer_idx: int, layer: LayerWeights, x: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor, batch: ForwardBatch, pool: UnifiedPool, flat: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        tokens = x.shape[0]
        q = self._proj(layer, "q_proj", x, flat, batch).view(tokens, cfg.num_heads, cfg.head_dim)
        k = self._proj(layer, "k_proj", x, flat, batch).view(tokens, cfg.num_kv_heads, cfg.head_dim)
        v = self._proj(layer, "v_proj", x, flat, batch)
        q = Rotary.apply(q, cos, sin)
        k = Rotary.apply(k, cos, sin)
        pool.write_kv(layer_idx, batch.kv_page_ids, batch.kv_slots, k.reshape(tokens, cfg.kv_dim), v)
        out = torch.empty(tokens, cfg.num_heads, cfg.head_dim, dtype=x.dtype, device=x.device)
        group = cfg.num_heads // cfg.num_kv_heads
        for row in batch.rows:
            keys, values = pool.read_kv(layer_idx, row.pages, row.context)
            keys = keys.view(row.context, cfg.num_kv_heads, cfg.head_dim).repeat_interleave(group, dim=1)
            values = values.view(row.context, cfg.num_kv_heads, cfg.head_dim).repeat_interleave(group, dim=1)
            qr = q[row.first:row.first + row.count]
            mask = self._mask(row, x.device)
            o = F.scaled_dot_product_attention(
                qr.transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1),
                attn_mask=mask, scale=self.scale,
            )  # [heads, count, head_dim]
            out[row.first:row.first + row.count] = o.transpose(0, 1)
        return out.view(tokens, cfg.q_dim)

    def _mask(self, row: RowSpan, device: torch.device) -> torch.Tensor | None:
        window = self.cfg.sliding_window
        if row.count == 1 and (window is None or row.context <= window):
            return None  # a decode token sees its whole context
        q_pos = torch.arange(row.start_pos, row.start_pos + row.count, device=device)[:, None]
        k_pos = torch.arange(row.context, device=device)[None, :]
        mask = k_pos <= q_pos
        if window is not None:
            mask &= (q_pos - k_pos) < window
        return mask
