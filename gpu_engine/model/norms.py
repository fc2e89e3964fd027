"""The norms and activations of the served families, each computed as
transformers does it (float32 statistics, the cast where HF casts), so the
engine's output matches the reference to float rounding."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama/Qwen: float32 statistics, cast back, then times w."""
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def rms_norm_1p(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma: float32 statistics times (1 + w) in float32, then cast back."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h * (1.0 + weight.float())).type_as(x)


def norm(kind: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    """ModelConfig.norm's kind: "rms", "rms1p" or "layer" (LayerNorm with its bias)."""
    if kind == "rms":
        return rms_norm(x, weight, eps)
    if kind == "rms1p":
        return rms_norm_1p(x, weight, eps)
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def activation(kind: str, x: torch.Tensor) -> torch.Tensor:
    """ModelConfig.activation: "silu" or "gelu_tanh" (gelu_pytorch_tanh and gelu_new alike)."""
    return F.silu(x) if kind == "silu" else F.gelu(x, approximate="tanh")


def softcap(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    """cap·tanh(x / cap) (Gemma 2's logit soft-capping); x itself without a cap."""
    return x if cap is None else torch.tanh(x / cap) * cap
