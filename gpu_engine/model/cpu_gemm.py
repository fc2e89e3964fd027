"""The base model's projections on a CPU engine, through weights prepacked in oneDNN's blocked
layout (the path vLLM's CPU build takes) instead of `F.linear` on the dense weight.

On this project's 2-core AVX2 host, one thread, float32, at the `cpu` shape (bench/cpu_gemm.py,
bench/RESULTS.md "Packed CPU weights"), the MLP's projections ran 1.1-1.5x faster packed at 8-512
rows and the attention ones about even; the engine's prefill 1.15x and its generation 1.2x. For
one row F.linear's matrix-vector path measured as fast or faster, so inputs of fewer than
PACKED_MIN_ROWS rows take F.linear.

The packed copy is made on a weight's first use and remade whenever the weight changes in place
(a dLoRA merge or unmerge bumps its version counter) or is replaced (an untied LM head), so it
never serves stale values. It costs a second copy of every projection weight,
so `model.cpu_packed_weights` turns it off where host memory is short.

Used only for float32 on CPU where this torch has oneDNN's linear ops; everything else (CUDA,
bfloat16, a weight without a version counter) runs `F.linear` as before.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

PACK_HINT_ROWS = 16  # the batch rows oneDNN picks the layout for; 16 and 128 measured alike from 8 rows up
PACKED_MIN_ROWS = 4  # fewer rows: F.linear (packed measured slower at 1 row, about even at 2-3)


def packed_linear_available() -> bool:
    """Whether this torch can pack a linear weight for oneDNN and run it."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        return bool(torch.ops.mkldnn._reorder_linear_weight and torch.ops.mkldnn._linear_pointwise)
    except (AttributeError, RuntimeError):
        return False


@dataclass(slots=True)
class _Packed:
    weight: torch.Tensor  # the dense weight it was made from
    version: int
    packed: torch.Tensor


class CpuGemm:
    """`linear(site, x, weight, bias)`: F.linear's result, through a packed copy of `weight` where
    that applies (module docstring). `site` names the projection ((layer, module), "lm_head"): one
    packed copy per site, replaced when the site's weight is another tensor or has changed."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled and packed_linear_available()
        self._packs: dict[object, _Packed] = {}

    def linear(self, site: object, x: torch.Tensor, weight: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
        rows = x.numel() // max(1, x.shape[-1])
        if not self.enabled or rows < PACKED_MIN_ROWS or x.dtype != weight.dtype or x.shape[-1] != weight.shape[1]:
            return F.linear(x, weight, bias)
        packed = self._packed(site, weight)
        if packed is None:
            return F.linear(x, weight, bias)
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")

    def _packed(self, site: object, weight: torch.Tensor) -> torch.Tensor | None:
        if weight.device.type != "cpu" or weight.dtype != torch.float32 or weight.dim() != 2:
            return None
        try:
            version = weight._version
        except RuntimeError:  # an inference tensor keeps no version: a change could not be seen
            return None
        entry = self._packs.get(site)
        if entry is None or entry.weight is not weight or entry.version != version:
            entry = _Packed(weight, version, torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_HINT_ROWS))
            self._packs[site] = entry
        return entry.packed

    @property
    def packed_weights(self) -> int:
        return len(self._packs)
