"""The decode LoRA kernel body shared by BGMV and MBGMV: one token per row,
shrink `y = x A^T`, expand `out += s * y B^T`, A and B^T rows read straight from
the unified pool through `LoraTables`.

One constexpr tells the two apart. PAD_TO_MAX (BGMV, Punica): every row runs
one rank tile of the batch's padded maximum rank, so its cost is |rows| x max
rank. Otherwise (MBGMV, Toppings/S-LoRA): each row loops over its own adapter's
rank in BLOCK_R tiles and pays for nothing more, a cost of the sum of the
ranks. Rows whose slot is -1 (no adapter, or beyond the live count) exit at
once, so a capacity-sized grid is CUDA-graph safe. `lora_bgmv` and `lora_mbgmv`
hold the public launchers.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from loraplex.kernels._jit import SUM
from loraplex.kernels.lora_tables import (
    LoraTables,
    check_index,
    check_lora_args,
    check_outputs,
    output_args,
    reference_expand,
    reference_shrink,
)
from loraplex.kernels.runtime import (
    KernelLaunch,
    block_default,
    check_blocks,
    check_device,
    check_tensor,
    interpret_mode,
    kernel_launch,
    next_pow2,
)


@triton.jit(do_not_specialize=["split_k"])  # one binary for every split count, 1 included
def _gemv_shrink_kernel(x_ptr, flat_ptr, slot_ptr, a_off_ptr, rank_ptr, y_ptr,
                        K, num_slots, width, stride_xt, stride_ym, stride_yt, split_k,
                        BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, PAD_TO_MAX: tl.constexpr):
    t = tl.program_id(0)
    m = tl.program_id(1)
    ks = tl.program_id(2)
    slot = tl.load(slot_ptr + t)
    if slot < 0:
        return
    rank = tl.load(rank_ptr + m * num_slots + slot)
    if rank == 0:
        return
    table = a_off_ptr + (m * num_slots + slot) * width
    if PAD_TO_MAX:
        stop = BLOCK_R  # one tile of the batch's max rank: every row pays for it
    else:
        stop = rank  # this row's rank only: no work for padding
    for r0 in range(0, stop, BLOCK_R):
        j = r0 + tl.arange(0, BLOCK_R)
        jmask = j < rank
        rows = tl.load(table + j, mask=jmask, other=0)
        acc = tl.full([BLOCK_R], 0.0, dtype=tl.float32)
        for k0 in range(ks * BLOCK_K, K, split_k * BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            kmask = k < K
            xv = tl.load(x_ptr + t * stride_xt + k, mask=kmask, other=0.0).to(tl.float32)
            a = tl.load(flat_ptr + rows[:, None] + k[None, :], mask=jmask[:, None] & kmask[None, :], other=0.0)
            acc += tl.reduce(a.to(tl.float32) * xv[None, :], 1, SUM)
        dst = y_ptr + m * stride_ym + t * stride_yt + j
        if split_k == 1:
            tl.store(dst, acc, mask=jmask)
        else:  # split_k programs add into one zeroed row
            tl.atomic_add(dst, acc, mask=jmask)


@triton.jit
def _gemv_expand_kernel(y_ptr, flat_ptr, slot_ptr, b_off_ptr, rank_ptr, scale_ptr,
                        out0, out1, out2, n0, n1, n2, so0, so1, so2,
                        num_slots, width, stride_ym, stride_yt,
                        BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, PAD_TO_MAX: tl.constexpr):
    t = tl.program_id(0)
    m = tl.program_id(1)
    nb = tl.program_id(2)
    slot = tl.load(slot_ptr + t)
    if slot < 0:
        return
    rank = tl.load(rank_ptr + m * num_slots + slot)
    n_cols = tl.where(m == 0, n0, tl.where(m == 1, n1, n2))
    if (rank == 0) | (nb * BLOCK_N >= n_cols):
        return
    n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < n_cols
    table = b_off_ptr + (m * num_slots + slot) * width
    if PAD_TO_MAX:
        stop = BLOCK_R
    else:
        stop = rank
    acc = tl.full([BLOCK_N], 0.0, dtype=tl.float32)
    for r0 in range(0, stop, BLOCK_R):
        j = r0 + tl.arange(0, BLOCK_R)
        jmask = j < rank
        yv = tl.load(y_ptr + m * stride_ym + t * stride_yt + j, mask=jmask, other=0.0)
        rows = tl.load(table + j, mask=jmask, other=0)
        bt = tl.load(flat_ptr + rows[:, None] + n[None, :], mask=jmask[:, None] & nmask[None, :], other=0.0)
        acc += tl.reduce(yv[:, None] * bt.to(tl.float32), 0, SUM)
    delta = acc * tl.load(scale_ptr + slot)
    offsets = t * tl.where(m == 0, so0, tl.where(m == 1, so1, so2)) + n
    if m == 0:
        ptrs = out0 + offsets
    elif m == 1:
        ptrs = out1 + offsets
    else:
        ptrs = out2 + offsets
    cur = tl.load(ptrs, mask=nmask, other=0.0)
    tl.store(ptrs, (cur.to(tl.float32) + delta).to(cur.dtype), mask=nmask)


# A padded B^T tile on a GPU, padded rank -> (largest block_n, warps once the tile holds 8192 elements or
# more), from the compile figures (bench/kernel_compile.py, bench/RESULTS.md): 16384-element tiles at 4
# warps held 150-250 registers a thread from rank 64 up, and ptxas spilled float16 at rank 128 x 64 on 4
# warps and at rank 256 below block_n 64 or on 8 warps; other ranks: block_n up to 256 on 4 warps.
PADDED_EXPAND_TILES = {64: (128, 8), 128: (64, 8), 256: (64, 4)}


def default_split_k(k_blocks: int, programs: int, interpreted: bool) -> int:
    """Split the reduction when there are too few (row, module) programs to fill a GPU."""
    if interpreted or programs >= 256:
        return 1
    return max(1, min(k_blocks, 256 // max(programs, 1), 16))


def rank_block(max_rank: int, padded: bool, block_r: int | None, interpreted: bool) -> int:
    """BGMV: the padded max rank (one tile); MBGMV: a tile the rank loops over."""
    if padded:
        return max(next_pow2(max_rank), 2)
    return block_r or max(2, min(next_pow2(max_rank), block_default(16, 64, interpreted)))


def gemv_shrink_launch(*, max_rank: int, padded: bool, in_features: int, tokens: int, num_modules: int,
                       x_dtype: torch.dtype, flat_dtype: torch.dtype, index_dtype: torch.dtype, interpreted: bool,
                       split_k: int | None = None, block_k: int | None = None,
                       block_r: int | None = None) -> tuple[KernelLaunch, int]:
    """The shrink launch for these sizes and dtypes, and its split count (grid axis 2)."""
    block_r = rank_block(max_rank, padded, block_r, interpreted)
    # a padded tile holds the whole rank: keep its A tile (block_r x block_k) within registers. On a GPU
    # 4096 elements: 8192 spilled at ranks 128 and 256 (bench/kernel_compile.py, bench/RESULTS.md)
    cap_k = block_default(4096, 8192, interpreted) // block_r if padded else 1 << 30
    block_k = block_k or max(16, min(next_pow2(in_features), block_default(512, 4096, interpreted), cap_k))
    split_k = split_k or default_split_k(triton.cdiv(in_features, block_k), tokens * num_modules, interpreted)
    if split_k < 1:
        raise ValueError(f"split_k must be >= 1, got {split_k}")
    launch = kernel_launch("lora_gemv", "_gemv_shrink_kernel",
                           {"BLOCK_R": block_r, "BLOCK_K": block_k, "PAD_TO_MAX": padded},
                           {"x_ptr": x_dtype, "flat_ptr": flat_dtype, "slot_ptr": index_dtype,
                            "a_off_ptr": torch.int64, "rank_ptr": torch.int32, "y_ptr": torch.float32})
    return launch, split_k


def gemv_expand_launch(*, max_rank: int, padded: bool, max_out: int, flat_dtype: torch.dtype,
                       out_dtype: torch.dtype, index_dtype: torch.dtype, interpreted: bool,
                       block_n: int | None = None, block_r: int | None = None) -> KernelLaunch:
    """The expand launch for these sizes and dtypes (max_out: the widest output's columns)."""
    block_r = rank_block(max_rank, padded, block_r, interpreted)
    if not padded:
        cap_n, tile_warps = 1 << 30, 4
    elif interpreted:
        cap_n, tile_warps = 16384 // block_r, 4
    else:
        cap_n, tile_warps = PADDED_EXPAND_TILES.get(block_r, (256, 4))
    block_n = block_n or max(16, min(next_pow2(max_out), block_default(256, 1024, interpreted), cap_n))
    return kernel_launch("lora_gemv", "_gemv_expand_kernel",
                         {"BLOCK_R": block_r, "BLOCK_N": block_n, "PAD_TO_MAX": padded},
                         {"y_ptr": torch.float32, "flat_ptr": flat_dtype, "slot_ptr": index_dtype,
                          "b_off_ptr": torch.int64, "rank_ptr": torch.int32, "scale_ptr": torch.float32,
                          "out0": out_dtype, "out1": out_dtype, "out2": out_dtype},
                         num_warps=tile_warps if block_r * block_n >= 8192 else 4)


def gemv_shrink(x: torch.Tensor, flat: torch.Tensor, token_slot: torch.Tensor, tables: LoraTables, *, padded: bool,
                split_k: int | None = None, block_k: int | None = None, block_r: int | None = None) -> torch.Tensor:
    """x: [T, in] (T = capacity), token_slot: [T] (-1 = none) -> y: [M, T, R] float32, R the padded max rank
    (padded) or the tables' width."""
    check_lora_args(x, flat, tables, tables.num_modules)
    tokens, k = x.shape
    check_index("token_slot", token_slot, tokens)
    device = check_device(x, flat, token_slot, tables.a_off, tables.ranks, kernel=_gemv_shrink_kernel)
    launch, split_k = gemv_shrink_launch(
        max_rank=tables.max_rank, padded=padded, in_features=k, tokens=tokens, num_modules=tables.num_modules,
        x_dtype=x.dtype, flat_dtype=flat.dtype, index_dtype=token_slot.dtype,
        interpreted=interpret_mode(), split_k=split_k, block_k=block_k, block_r=block_r)
    block_r = launch.const("BLOCK_R")
    check_blocks(device, block_k=launch.const("BLOCK_K"), block_r=block_r)
    alloc = torch.zeros if split_k > 1 else torch.empty
    y = alloc(tables.num_modules, tokens, block_r if padded else tables.width, dtype=torch.float32, device=device)
    if tokens == 0:
        return y
    grid = (tokens, tables.num_modules, split_k)
    _gemv_shrink_kernel[grid](x, flat, token_slot, tables.a_off, tables.ranks, y,
                              k, tables.num_slots, tables.width, x.stride(0), y.stride(0), y.stride(1), split_k,
                              **launch.options)
    return y


def gemv_expand(outs: Sequence[torch.Tensor], y: torch.Tensor, flat: torch.Tensor, token_slot: torch.Tensor,
                tables: LoraTables, *, padded: bool, block_n: int | None = None, block_r: int | None = None) -> None:
    """outs[m]: [T, out_m] += scaling * y[m] @ B^T_m per row's slot, in place (up to three outputs)."""
    check_tensor("y", y, ndim=3, dtypes=(torch.float32,), shape=(len(outs), None, None))
    tokens = y.shape[1]
    check_outputs(outs, tokens)
    check_lora_args(None, flat, tables, len(outs))
    check_index("token_slot", token_slot, tokens)
    device = check_device(y, flat, token_slot, tables.b_off, *outs, kernel=_gemv_expand_kernel)
    if y.shape[2] < tables.max_rank:
        raise ValueError(f"y holds {y.shape[2]} rank columns, tables need {tables.max_rank}")
    max_n = max(o.shape[1] for o in outs)
    launch = gemv_expand_launch(max_rank=tables.max_rank, padded=padded, max_out=max_n, flat_dtype=flat.dtype,
                                out_dtype=outs[0].dtype, index_dtype=token_slot.dtype,
                                interpreted=interpret_mode(), block_n=block_n,
                                block_r=block_r)
    block_n = launch.const("BLOCK_N")
    check_blocks(device, block_n=block_n, block_r=launch.const("BLOCK_R"))
    if tokens == 0:
        return
    grid = (tokens, len(outs), triton.cdiv(max_n, block_n))
    _gemv_expand_kernel[grid](y, flat, token_slot, tables.b_off, tables.ranks, tables.scaling,
                              *output_args(outs), tables.num_slots, tables.width, y.stride(0), y.stride(1),
                              **launch.options)


def gemv_reference(outs: Sequence[torch.Tensor], x: torch.Tensor, flat: torch.Tensor, token_slot: torch.Tensor,
                   tables: LoraTables) -> None:
    """Torch reference of shrink + expand (BGMV and MBGMV compute the same), in place on outs."""
    y = reference_shrink(x, flat, token_slot, tables, x.shape[1])
    reference_expand(outs, y, flat, token_slot, tables)
