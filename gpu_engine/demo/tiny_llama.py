"""A trainable Llama in plain torch for the demo trainer, with optional LoRA.

Owns the training-time forward pass, which must equal the serving engine's math
(float32-statistics RMSNorm, rotate-half RoPE, causal GQA attention, SwiGLU,
tied embeddings) and the HF / PEFT tensor names it saves under. It never
imports transformers or peft and is not used for serving.
"""
from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .adapter import lora_scaling
from .checkpoint import head_dim_of, module_prefix

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


class LoraLinear(nn.Module):
    """A frozen-or-trained base linear plus an optional LoRA: y = x Wᵀ + s·(x Aᵀ) Bᵀ."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))  # [out, in]
        self.lora_a: nn.Parameter | None = None  # [r, in]
        self.lora_b: nn.Parameter | None = None  # [out, r]
        self.scaling = 0.0

    def add_lora(self, rank: int, scaling: float, gen: torch.Generator) -> None:
        """PEFT's initialisation: A kaiming-uniform (a=√5), B zero, so training starts at the base model."""
        out_f, in_f = self.weight.shape
        bound = 1.0 / math.sqrt(in_f)  # kaiming_uniform_ with a=sqrt(5) on fan_in = in_f
        self.lora_a = nn.Parameter((torch.rand((rank, in_f), generator=gen) * 2 - 1) * bound)
        self.lora_b = nn.Parameter(torch.zeros(out_f, rank))
        self.scaling = scaling

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.lora_a is None or self.lora_b is None:
            return F.linear(x, self.weight)
        # (W + s·B A) x equals W x + s·B (A x); one big matmul trains faster on CPU than three.
        return F.linear(x, self.weight + self.scaling * (self.lora_b @ self.lora_a))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.float()
    return weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [batch, heads, seq, head_dim]; cos/sin: [seq, head_dim]
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


class Block(nn.Module):
    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        hidden, inter = int(cfg["hidden_size"]), int(cfg["intermediate_size"])
        self.heads = int(cfg["num_attention_heads"])
        self.kv_heads = int(cfg["num_key_value_heads"])
        self.head_dim = head_dim_of(cfg)
        self.eps = float(cfg["rms_norm_eps"])
        q_w, kv_w = self.heads * self.head_dim, self.kv_heads * self.head_dim
        self.input_layernorm = nn.Parameter(torch.ones(hidden))
        self.post_attention_layernorm = nn.Parameter(torch.ones(hidden))
        self.proj = nn.ModuleDict({
            "q_proj": LoraLinear(hidden, q_w), "k_proj": LoraLinear(hidden, kv_w),
            "v_proj": LoraLinear(hidden, kv_w), "o_proj": LoraLinear(q_w, hidden),
            "gate_proj": LoraLinear(hidden, inter), "up_proj": LoraLinear(hidden, inter),
            "down_proj": LoraLinear(inter, hidden),
        })

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # h: [batch, seq, hidden]
        b, t, _ = h.shape
        p = self.proj
        x = rms_norm(h, self.input_layernorm, self.eps)
        q = p["q_proj"](x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = p["k_proj"](x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = p["v_proj"](x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        group = self.heads // self.kv_heads
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [batch, heads, seq, head_dim]
        h = h + p["o_proj"](attn.transpose(1, 2).reshape(b, t, -1))
        x = rms_norm(h, self.post_attention_layernorm, self.eps)
        return h + p["down_proj"](F.silu(p["gate_proj"](x)) * p["up_proj"](x))


class TinyLlama(nn.Module):
    """LlamaForCausalLM with tied embeddings, sized by an HF config dict."""

    def __init__(self, cfg: dict[str, Any], *, seed: int) -> None:
        super().__init__()
        if not cfg.get("tie_word_embeddings"):
            raise ValueError("the demo trainer writes tied-embedding checkpoints only")
        self.cfg = cfg
        hidden = int(cfg["hidden_size"])
        self.embed = nn.Parameter(torch.empty(int(cfg["vocab_size"]), hidden))
        self.layers = nn.ModuleList(Block(cfg) for _ in range(int(cfg["num_hidden_layers"])))
        self.norm = nn.Parameter(torch.ones(hidden))
        head_dim = head_dim_of(cfg)
        self.register_buffer(
            "inv_freq",
            1.0 / (float(cfg["rope_theta"]) ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)),
            persistent=False,
        )
        gen = torch.Generator().manual_seed(seed)
        std = float(cfg["initializer_range"])
        with torch.no_grad():
            self.embed.normal_(0.0, std, generator=gen)
            for layer in self.layers:
                for name, lin in layer.proj.items():
                    # GPT-2 style: residual-writing projections start smaller with depth.
                    scale = 1.0 / math.sqrt(2 * len(self.layers)) if name in ("o_proj", "down_proj") else 1.0
                    lin.weight.normal_(0.0, std * scale, generator=gen)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids: [batch, seq] -> float32 logits [batch, seq, vocab]."""
        h = F.embedding(ids, self.embed)
        freqs = torch.arange(ids.shape[1], dtype=torch.float32)[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)  # [seq, head_dim]
        cos, sin = emb.cos(), emb.sin()
        for layer in self.layers:
            h = layer(h, cos, sin)
        return F.linear(rms_norm(h, self.norm, float(self.cfg["rms_norm_eps"])), self.embed).float()

    def add_lora(self, rank: int, alpha: float, targets: tuple[str, ...], *, seed: int) -> list[nn.Parameter]:
        """Freeze the base, attach fresh LoRA to `targets` in every layer; returns the trainable parameters."""
        for p in self.parameters():
            p.requires_grad_(False)
        gen = torch.Generator().manual_seed(seed)
        scaling = lora_scaling(rank, alpha, use_rslora=False)
        params: list[nn.Parameter] = []
        for layer in self.layers:
            for name in targets:
                lin = layer.proj[name]
                lin.add_lora(rank, scaling, gen)
                params += [lin.lora_a, lin.lora_b]  # type: ignore[list-item]
        return params

    def hf_state_dict(self, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """The base weights under HF Llama names (no lm_head: embeddings are tied)."""
        return {k: v.detach().to(dtype).contiguous() for k, v in self._named_hf_params()}

    def peft_state_dict(self, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """The LoRA weights under PEFT names."""
        out: dict[str, torch.Tensor] = {}
        for i, layer in enumerate(self.layers):
            for name, lin in layer.proj.items():
                if lin.lora_a is None or lin.lora_b is None:
                    continue
                base = f"base_model.model.model.layers.{i}.{module_prefix(name)}.{name}"
                out[f"{base}.lora_A.weight"] = lin.lora_a.detach().to(dtype).contiguous()
                out[f"{base}.lora_B.weight"] = lin.lora_b.detach().to(dtype).contiguous()
        return out

    def load_hf_state_dict(self, tensors: dict[str, torch.Tensor]) -> None:
        """Inverse of hf_state_dict (values cast to float32)."""
        params = dict(self._named_hf_params())
        if set(tensors) != set(params):
            raise ValueError(f"checkpoint tensors differ: {sorted(set(tensors) ^ set(params))[:4]}")
        with torch.no_grad():
            for key, value in tensors.items():
                params[key].copy_(value.float())

    def _named_hf_params(self) -> Iterator[tuple[str, nn.Parameter]]:
        yield "model.embed_tokens.weight", self.embed
        yield "model.norm.weight", self.norm
        for i, layer in enumerate(self.layers):
            yield f"model.layers.{i}.input_layernorm.weight", layer.input_layernorm
            yield f"model.layers.{i}.post_attention_layernorm.weight", layer.post_attention_layernorm
            for name, lin in layer.proj.items():
                yield f"model.layers.{i}.{module_prefix(name)}.{name}.weight", lin.weight
