"""Llama-family forward pass (Llama, Mistral, Qwen2) over one continuous-batching
step: prefill chunks and decode tokens of many sequences flattened into one
token axis, KV read and written through the unified pool's page tables, and
unmerged LoRA on every targeted projection.

Numerics follow the reference implementation (float32 RMSNorm statistics,
rotate-half RoPE, SDPA attention) so results match transformers + PEFT.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from loraplex.gpu_engine.lora.backend import LoraBackend
from loraplex.gpu_engine.model.attention_torch import TorchPagedAttention
from loraplex.gpu_engine.model.batch import ForwardBatch
from loraplex.gpu_engine.model.config import ModelConfig
from loraplex.gpu_engine.model.rope import Rotary
from loraplex.gpu_engine.model.weights import LayerWeights, ModelWeights
from loraplex.gpu_engine.pool import UnifiedPool


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


class LlamaModel:
    def __init__(self, cfg: ModelConfig, weights: ModelWeights, lora: LoraBackend,
                 attention: TorchPagedAttention | None = None) -> None:
        self.cfg = cfg
        self.w = weights
        self.lora = lora
        self.rotary = Rotary(cfg, weights.embed.device)
        self.attention = attention or TorchPagedAttention(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                                                          cfg.sliding_window)

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
        out = self.attention.forward(q, layer_idx, batch, pool)
        return out.view(tokens, cfg.q_dim)
