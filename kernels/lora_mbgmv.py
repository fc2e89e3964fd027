"""MBGMV (Toppings/S-LoRA): decode LoRA, one token per row, each row looping only
over its own adapter's rank (no padding). Shrink `y = x A^T`, expand `out += s * y B^T`.

The kernel body is `lora_gemv`'s without PAD_TO_MAX; cost model: sum of the rows' ranks.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from loraplex.kernels.lora_gemv import gemv_expand, gemv_reference, gemv_shrink
from loraplex.kernels.lora_tables import LoraTables


def mbgmv_shrink(x: torch.Tensor, flat: torch.Tensor, token_slot: torch.Tensor, tables: LoraTables, *,
                 split_k: int | None = None, block_k: int | None = None,
                 block_r: int | None = None) -> torch.Tensor:
    """x: [T, in] (T = capacity), token_slot: [T] (-1 = none) -> y: [M, T, width] float32."""
    return gemv_shrink(x, flat, token_slot, tables, padded=False, split_k=split_k, block_k=block_k, block_r=block_r)


def mbgmv_expand(outs: Sequence[torch.Tensor], y: torch.Tensor, flat: torch.Tensor, token_slot: torch.Tensor,
                 tables: LoraTables, *, block_n: int | None = None, block_r: int | None = None) -> None:
    """outs[m]: [T, out_m] += scaling * y[m] @ B^T_m per row's slot, in place (up to three outputs)."""
    gemv_expand(outs, y, flat, token_slot, tables, padded=False, block_n=block_n, block_r=block_r)


mbgmv_reference = gemv_reference
