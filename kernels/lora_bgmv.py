"""BGMV (Punica): decode LoRA, one token per row, every row's tile padded to the
batch's maximum rank. Shrink `y = x A^T`, expand `out += s * y B^T`.

The kernel body is `lora_gemv`'s with PAD_TO_MAX; cost model: |rows| x max rank.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from loraplex.kernels.lora_gemv import gemv_expand, gemv_reference, gemv_shrink
from loraplex.kernels.lora_tables import LoraTables


def bgmv_shrink(x: torch.Tensor, flat: torch.Tensor, token_slot: torch.Tensor, tables: LoraTables, *,
                split_k: int | None = None, block_k: int | None = None) -> torch.Tensor:
    """x: [T, in] (T = capacity), token_slot: [T] (-1 = none) -> y: [M, T, R_pad] float32."""
    return gemv_shrink(x, flat, token_slot, tables, padded=True, split_k=split_k, block_k=block_k)


def bgmv_expand(outs: Sequence[torch.Tensor], y: torch.Tensor, flat: torch.Tensor, token_slot: torch.Tensor,
                tables: LoraTables, *, block_n: int | None = None) -> None:
    """outs[m]: [T, out_m] += scaling * y[m] @ B^T_m per row's slot, in place (up to three outputs)."""
    gemv_expand(outs, y, flat, token_slot, tables, padded=True, block_n=block_n)


bgmv_reference = gemv_reference
