"""Rotary position embeddings with the scalings HF checkpoints use (none, linear,
llama3, longrope), over all of a head or its leading rotary_dim dims (partial
rotary: Phi, Phi-3), with a RoPE base per layer kind (Gemma 3's sliding layers),
computed exactly as the reference implementation does."""
from __future__ import annotations

import math

import torch

from loraplex.gpu_engine.model.config import ModelConfig, RopeScaling, UnsupportedModelError


def _base_frequencies(theta: float, dim: int) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def inverse_frequencies(cfg: ModelConfig, *, theta: float | None = None, scaling: RopeScaling | None = None,
                        factors: tuple[float, ...] = ()) -> torch.Tensor:
    dim = cfg.rope_dim
    scaling = cfg.rope_scaling if scaling is None else scaling
    if factors:  # longrope: the base frequencies divided per dimension (transformers' ext_factors)
        shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
        return 1.0 / (torch.tensor(factors, dtype=torch.float32) * (theta or cfg.rope_theta) ** shape)
    inv_freq = _base_frequencies(theta or cfg.rope_theta, dim)
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    if scaling.rope_type == "llama3":
        old_len = scaling.original_max_position_embeddings
        low_wavelen = old_len / scaling.low_freq_factor
        high_wavelen = old_len / scaling.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
        smooth = (old_len / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
        smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
    return inv_freq


class Rotary:
    """cos/sin tables per position; applied to [tokens, heads, head_dim] in place of HF's rotate_half.
    local=True: the sliding layers' tables (Gemma 3: their own base, unscaled)."""

    def __init__(self, cfg: ModelConfig, device: torch.device, *, local: bool = False) -> None:
        scaling = cfg.rope_scaling
        theta = cfg.rope_theta
        if local:
            scaling, theta = RopeScaling(), cfg.local_rope_theta
        self.long_from: int | None = None  # longrope: a row reaching past this length uses the long factors
        self.attention_factor = 1.0
        if scaling.rope_type == "longrope":
            half = cfg.rope_dim // 2
            if len(scaling.short_factor) != half:
                raise UnsupportedModelError(
                    f"rope_scaling.short_factor has {len(scaling.short_factor)} values, the rotary width needs {half}")
            self.inv_freq = inverse_frequencies(cfg, theta=theta, factors=scaling.short_factor).to(device)
            self.long_inv_freq = inverse_frequencies(cfg, theta=theta, factors=scaling.long_factor).to(device)
            self.long_from = scaling.original_max_position_embeddings
            self.attention_factor = scaling.attention_factor
        else:
            self.inv_freq = inverse_frequencies(cfg, theta=theta, scaling=scaling).to(device)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype, seq_ends: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [tokens] -> cos, sin: [tokens, 1, rotary_dim]. seq_ends: [tokens] the length each
        token's row reaches in this step (longrope picks its factors per row as transformers does per
        forward; default: the token's own position + 1)."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        if self.long_from is not None:
            ends = positions + 1 if seq_ends is None else seq_ends
            long = positions.float()[:, None] * self.long_inv_freq[None, :]
            freqs = torch.where((ends > self.long_from)[:, None], long, freqs)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if self.attention_factor != 1.0:
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        return cos.to(dtype)[:, None, :], sin.to(dtype)[:, None, :]

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        dim = cos.shape[-1]
        if dim == 0:
            return x
        if dim != x.shape[-1]:  # partial rotary: the leading dims rotate, the rest pass through
            return torch.cat((Rotary.apply(x[..., :dim], cos, sin), x[..., dim:]), dim=-1)
        half = dim // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin
