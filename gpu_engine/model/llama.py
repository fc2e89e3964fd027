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
from loraplex.gpu_engine.lora.torch_backend import LoraGroup
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
        self.attention = attention or TorchPagedAttention.for_config(cfg)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, pool: UnifiedPool) -> torch.Tensor:
        """Returns float32 logits [S, vocab] for the sampled tokens (and keeps the final states of
        batch.score_tokens in batch.scored_hidden)."""
        h = self._embed(batch.token_ids)  # [T, hidden]
        cos, sin = self.rotary.cos_sin(batch.positions, h.dtype)
        cpu = batch.cpu
        for layer_idx, layer in enumerate(self.w.layers):
            flat = pool.layer_flat(layer_idx)
            groups = self._gpu_groups(batch, layer_idx)
            x = rms_norm(h, layer.input_norm, self.cfg.rms_norm_eps)
            attn = self._attention(layer_idx, layer, x, cos, sin, batch, pool, flat, groups)
            if cpu is not None:
                cpu.post(layer_idx, 1, attn)
            o = self._proj(layer, "o_proj", attn, flat, groups)
            if cpu is not None:
                cpu.collect(layer_idx, 1, attn, {"o_proj": o})
            h = h + o
            x = rms_norm(h, layer.post_norm, self.cfg.rms_norm_eps)
            if cpu is not None:
                cpu.post(layer_idx, 2, x)
            gate = self._proj(layer, "gate_proj", x, flat, groups)
            up = self._proj(layer, "up_proj", x, flat, groups)
            if cpu is not None:
                cpu.collect(layer_idx, 2, x, {"gate_proj": gate, "up_proj": up})
            act = F.silu(gate) * up
            if cpu is not None:
                cpu.post(layer_idx, 3, act)
            down = self._proj(layer, "down_proj", act, flat, groups)
            if cpu is not None:
                cpu.collect(layer_idx, 3, act, {"down_proj": down})
            h = h + down
        if batch.score_tokens is not None:  # prompt logprobs: scored later, in chunks (rows are normed alone)
            batch.scored_hidden = rms_norm(h.index_select(0, batch.score_tokens), self.w.norm, self.cfg.rms_norm_eps)
        last = rms_norm(h.index_select(0, batch.sample_tokens), self.w.norm, self.cfg.rms_norm_eps)
        return self._logits(last)

    # _embed, _proj and _logits are where a tensor-parallel rank (gpu_engine/tp/model.py) differs.
    def _embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(token_ids, self.w.embed)

    def _logits(self, last: torch.Tensor) -> torch.Tensor:
        return F.linear(last, self.w.lm_head).float()

    def _gpu_groups(self, batch: ForwardBatch, layer: int) -> list[LoraGroup]:
        """Adapter segments whose LoRA runs from the pool at this layer; waits for layer groups in flight."""
        groups = [g for g in batch.lora_groups if g.on_gpu(layer)]
        for g in groups:
            if g.load is not None:
                batch.load_wait_ms += g.load.wait_layer(layer)
        return groups

    def _proj(self, layer: LayerWeights, name: str, x: torch.Tensor, flat: torch.Tensor,
              groups: list[LoraGroup]) -> torch.Tensor:
        out = F.linear(x, layer.proj[name], layer.bias.get(name))
        if groups:
            self.lora.apply(out, x, flat, name, groups)
        return out

    def _attention(self, layer_idx: int, layer: LayerWeights, x: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor, batch: ForwardBatch, pool: UnifiedPool, flat: torch.Tensor,
                   groups: list[LoraGroup]) -> torch.Tensor:
        cfg = self.cfg
        tokens = x.shape[0]
        if batch.cpu is not None:
            batch.cpu.post(layer_idx, 0, x)
        q = self._proj(layer, "q_proj", x, flat, groups)
        k = self._proj(layer, "k_proj", x, flat, groups)
        v = self._proj(layer, "v_proj", x, flat, groups)
        if batch.cpu is not None:
            batch.cpu.collect(layer_idx, 0, x, {"q_proj": q, "k_proj": k, "v_proj": v})
        q = q.view(tokens, cfg.num_heads, cfg.head_dim)
        k = k.view(tokens, cfg.num_kv_heads, cfg.head_dim)
        q = Rotary.apply(q, cos, sin)
        k = Rotary.apply(k, cos, sin)
        pool.write_kv(layer_idx, batch.kv_page_ids, batch.kv_slots, k.reshape(tokens, cfg.kv_dim), v)
        out = self.attention.forward(q, layer_idx, batch, pool)
        return out.view(tokens, cfg.q_dim)
