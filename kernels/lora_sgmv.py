"""SGMV / MBGMM (Punica, S-LoRA): prefill LoRA over token segments, one adapter
per segment, each segment looping only over its own rank. Shrink `y = x A^T`,
expand `out += s * y B^T`, both as tiled `tl.dot`s.

A and B^T rows come straight from the unified pool through `LoraTables`. The
grid is (token tiles of the longest segment capacity, segment capacity, modules):
dead segments (slot -1) and tiles past a segment's end exit at once.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

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


@triton.jit
def _sgmv_shrink_kernel(x_ptr, flat_ptr, start_ptr, len_ptr, seg_slot_ptr, a_off_ptr, rank_ptr, y_ptr,
                        K, num_slots, width, stride_xt, stride_ym, stride_yt,
                        BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
                        PRECISION: tl.constexpr):
    mt = tl.program_id(0)
    seg = tl.program_id(1)
    m = tl.program_id(2)
    slot = tl.load(seg_slot_ptr + seg)
    if slot < 0:
        return
    length = tl.load(len_ptr + seg)
    if mt * BLOCK_M >= length:
        return
    rank = tl.load(rank_ptr + m * num_slots + slot)
    i = mt * BLOCK_M + tl.arange(0, BLOCK_M)
    imask = i < length
    tok = tl.load(start_ptr + seg) + i
    table = a_off_ptr + (m * num_slots + slot) * width
    for r0 in range(0, rank, BLOCK_R):
        j = r0 + tl.arange(0, BLOCK_R)
        jmask = j < rank
        rows = tl.load(table + j, mask=jmask, other=0)
        acc = tl.full([BLOCK_M, BLOCK_R], 0.0, dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            kmask = k < K
            xt = tl.load(x_ptr + tok[:, None] * stride_xt + k[None, :], mask=imask[:, None] & kmask[None, :],
                         other=0.0)
            at = tl.load(flat_ptr + rows[None, :] + k[:, None], mask=kmask[:, None] & jmask[None, :], other=0.0)
            acc = tl.dot(xt, at, acc, input_precision=PRECISION)  # [BLOCK_M, BLOCK_R]
        tl.store(y_ptr + m * stride_ym + tok[:, None] * stride_yt + j[None, :], acc,
                 mask=imask[:, None] & jmask[None, :])


@triton.jit
def _sgmv_expand_kernel(y_ptr, flat_ptr, start_ptr, len_ptr, seg_slot_ptr, b_off_ptr, rank_ptr, scale_ptr,
                        out0, out1, out2, n0, n1, n2, so0, so1, so2,
                        num_slots, width, stride_ym, stride_yt, n_tiles,
                        BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
                        PRECISION: tl.constexpr):
    mt = tl.program_id(0) // n_tiles
    nb = tl.program_id(0) % n_tiles
    seg = tl.program_id(1)
    m = tl.program_id(2)
    slot = tl.load(seg_slot_ptr + seg)
    if slot < 0:
        return
    length = tl.load(len_ptr + seg)
    rank = tl.load(rank_ptr + m * num_slots + slot)
    n_cols = tl.where(m == 0, n0, tl.where(m == 1, n1, n2))
    if (mt * BLOCK_M >= length) | (rank == 0) | (nb * BLOCK_N >= n_cols):
        return
    i = mt * BLOCK_M + tl.arange(0, BLOCK_M)
    imask = i < length
    tok = tl.load(start_ptr + seg) + i
    n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < n_cols
    table = b_off_ptr + (m * num_slots + slot) * width
    acc = tl.full([BLOCK_M, BLOCK_N], 0.0, dtype=tl.float32)
    for r0 in range(0, rank, BLOCK_R):
        j = r0 + tl.arange(0, BLOCK_R)
        jmask = j < rank
        rows = tl.load(table + j, mask=jmask, other=0)
        yt = tl.load(y_ptr + m * stride_ym + tok[:, None] * stride_yt + j[None, :],
                     mask=imask[:, None] & jmask[None, :], other=0.0)
        bt = tl.load(flat_ptr + rows[:, None] + n[None, :], mask=jmask[:, None] & nmask[None, :], other=0.0)
        acc = tl.dot(yt.to(bt.dtype), bt, acc, input_precision=PRECISION)  # [BLOCK_M, BLOCK_N]
    delta = acc * tl.load(scale_ptr + slot)
    offsets = tok[:, None] * tl.where(m == 0, so0, tl.where(m == 1, so1, so2)) + n[None, :]
    if m == 0:
        ptrs = out0 + offsets
    elif m == 1:
        ptrs = out1 + offsets
    else:
        ptrs = out2 + offsets
    mask = imask[:, None] & nmask[None, :]
    cur = tl.load(ptrs, mask=mask, other=0.0)
    tl.store(ptrs, (cur.to(tl.float32) + delta).to(cur.dtype), mask=mask)


def _check_segments(seg_start: torch.Tensor, seg_len: torch.Tensor, seg_slot: torch.Tensor) -> int:
    check_index("seg_start", seg_start)
    segments = seg_start.shape[0]
    check_index("seg_len", seg_len, segments)
    check_index("seg_slot", seg_slot, segments)
    return segments


def _blocks(max_rank: int, block_m: int | None, block_r: int | None, interpreted: bool) -> tuple[int, int]:
    return (block_m or block_default(32, 64, interpreted),
            block_r or max(16, min(next_pow2(max_rank), block_default(64, 128, interpreted))))


def sgmv_shrink_launch(*, max_rank: int, in_features: int, dtype: torch.dtype, index_dtype: torch.dtype,
                       interpreted: bool, block_m: int | None = None, block_r: int | None = None,
                       block_k: int | None = None, precision: str = "ieee") -> KernelLaunch:
    """The shrink launch for these sizes and dtypes (x and the pool share `dtype`)."""
    block_m, block_r = _blocks(max_rank, block_m, block_r, interpreted)
    # float32 tiles of rank 64 x 64 spilled (bench/kernel_compile.py); x 32 spill nothing
    gpu_k = 32 if dtype == torch.float32 else 64
    block_k = block_k or max(16, min(next_pow2(in_features), block_default(gpu_k, 1024, interpreted)))
    return kernel_launch("lora_sgmv", "_sgmv_shrink_kernel",
                         {"BLOCK_M": block_m, "BLOCK_R": block_r, "BLOCK_K": block_k, "PRECISION": precision},
                         {"x_ptr": dtype, "flat_ptr": dtype, "start_ptr": index_dtype, "len_ptr": index_dtype,
                          "seg_slot_ptr": index_dtype, "a_off_ptr": torch.int64, "rank_ptr": torch.int32,
                          "y_ptr": torch.float32})


def sgmv_expand_launch(*, max_rank: int, max_out: int, flat_dtype: torch.dtype, out_dtype: torch.dtype,
                       index_dtype: torch.dtype, interpreted: bool, block_m: int | None = None,
                       block_r: int | None = None, block_n: int | None = None,
                       precision: str = "ieee") -> KernelLaunch:
    """The expand launch for these sizes and dtypes (max_out: the widest output's columns)."""
    block_m, block_r = _blocks(max_rank, block_m, block_r, interpreted)
    block_n = block_n or max(16, min(next_pow2(max_out), block_default(64, 1024, interpreted)))
    return kernel_launch("lora_sgmv", "_sgmv_expand_kernel",
                         {"BLOCK_M": block_m, "BLOCK_R": block_r, "BLOCK_N": block_n, "PRECISION": precision},
                         {"y_ptr": torch.float32, "flat_ptr": flat_dtype, "start_ptr": index_dtype,
                          "len_ptr": index_dtype, "seg_slot_ptr": index_dtype, "b_off_ptr": torch.int64,
                          "rank_ptr": torch.int32, "scale_ptr": torch.float32, "out0": out_dtype, "out1": out_dtype,
                          "out2": out_dtype})


def sgmv_shrink(x: torch.Tensor, flat: torch.Tensor, seg_start: torch.Tensor, seg_len: torch.Tensor,
                seg_slot: torch.Tensor, tables: LoraTables, max_seg_len: int, *, block_m: int | None = None,
                block_r: int | None = None, block_k: int | None = None,
                precision: str = "ieee") -> torch.Tensor:
    """x: [T, in]; segment s covers tokens seg_start[s] .. + seg_len[s] with slot seg_slot[s] (-1 = dead).

    max_seg_len bounds every seg_len (the grid's capacity). -> y: [M, T, width] float32 (rows outside
    every segment are left unwritten).
    """
    check_lora_args(x, flat, tables, tables.num_modules)
    if x.dtype != flat.dtype:
        raise ValueError(f"x ({x.dtype}) and the pool ({flat.dtype}) must share a dtype")
    segments = _check_segments(seg_start, seg_len, seg_slot)
    device = check_device(x, flat, seg_start, seg_len, seg_slot, tables.a_off, kernel=_sgmv_shrink_kernel)
    tokens, k = x.shape
    launch = sgmv_shrink_launch(max_rank=tables.max_rank, in_features=k, dtype=x.dtype, index_dtype=seg_start.dtype,
                                interpreted=interpret_mode(), block_m=block_m, block_r=block_r, block_k=block_k,
                                precision=precision)
    block_m = launch.const("BLOCK_M")
    check_blocks(device, 16, block_m=block_m, block_r=launch.const("BLOCK_R"), block_k=launch.const("BLOCK_K"))
    y = torch.empty(tables.num_modules, tokens, tables.width, dtype=torch.float32, device=device)
    if tokens == 0 or segments == 0 or max_seg_len <= 0:
        return y
    grid = (triton.cdiv(max_seg_len, block_m), segments, tables.num_modules)
    _sgmv_shrink_kernel[grid](x, flat, seg_start, seg_len, seg_slot, tables.a_off, tables.ranks, y,
                              k, tables.num_slots, tables.width, x.stride(0), y.stride(0), y.stride(1),
                              **launch.options)
    return y


def sgmv_expand(outs: Sequence[torch.Tensor], y: torch.Tensor, flat: torch.Tensor, seg_start: torch.Tensor,
                seg_len: torch.Tensor, seg_slot: torch.Tensor, tables: LoraTables, max_seg_len: int, *,
                block_m: int | None = None, block_r: int | None = None, block_n: int | None = None,
                precision: str = "ieee") -> None:
    """outs[m]: [T, out_m] += scaling * y[m] @ B^T_m over each segment, in place (up to three outputs)."""
    check_tensor("y", y, ndim=3, dtypes=(torch.float32,), shape=(len(outs), None, None))
    tokens = y.shape[1]
    check_outputs(outs, tokens)
    check_lora_args(None, flat, tables, len(outs))
    segments = _check_segments(seg_start, seg_len, seg_slot)
    device = check_device(y, flat, seg_start, seg_len, seg_slot, tables.b_off, *outs,
                 kernel=_sgmv_expand_kernel)
    if y.shape[2] < tables.max_rank:
        raise ValueError(f"y holds {y.shape[2]} rank columns, tables need {tables.max_rank}")
    max_n = max(o.shape[1] for o in outs)
    launch = sgmv_expand_launch(max_rank=tables.max_rank, max_out=max_n, flat_dtype=flat.dtype,
                                out_dtype=outs[0].dtype, index_dtype=seg_start.dtype, interpreted=interpret_mode(),
                                block_m=block_m, block_r=block_r, block_n=block_n, precision=precision)
    block_m, block_n = launch.const("BLOCK_M"), launch.const("BLOCK_N")
    check_blocks(device, 16, block_m=block_m, block_r=launch.const("BLOCK_R"), block_n=block_n)
    if tokens == 0 or segments == 0 or max_seg_len <= 0:
        return
    n_tiles = triton.cdiv(max_n, block_n)
    grid = (triton.cdiv(max_seg_len, block_m) * n_tiles, segments, len(outs))
    _sgmv_expand_kernel[grid](y, flat, seg_start, seg_len, seg_slot, tables.b_off, tables.ranks, tables.scaling,
                              *output_args(outs), tables.num_slots, tables.width, y.stride(0), y.stride(1), n_tiles,
                              **launch.options)


def segment_token_slots(tokens: int, seg_start: torch.Tensor, seg_len: torch.Tensor,
                        seg_slot: torch.Tensor) -> torch.Tensor:
    """Per-token slot (-1 outside every segment) of a segment table (host-side helper)."""
    slot = torch.full((tokens,), -1, dtype=torch.int64)
    for start, length, s in zip(seg_start.tolist(), seg_len.tolist(), seg_slot.tolist()):
        if s >= 0:
            slot[start: start + length] = s
    return slot


def sgmv_reference(outs: Sequence[torch.Tensor], x: torch.Tensor, flat: torch.Tensor, seg_start: torch.Tensor,
                   seg_len: torch.Tensor, seg_slot: torch.Tensor, tables: LoraTables) -> None:
    """Torch reference of shrink + expand over segments, in place on outs."""
    token_slot = segment_token_slots(x.shape[0], seg_start, seg_len, seg_slot)
    y = reference_shrink(x, flat, token_slot, tables, x.shape[1])
    reference_expand(outs, y, flat, token_slot, tables)
