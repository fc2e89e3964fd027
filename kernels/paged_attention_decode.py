"""Paged decode attention, flash-decoding style: each row's context is split into
fixed chunks computed in parallel (partial max, sum and unnormalised output per
split), then a reduction kernel merges the splits. One program serves all query
heads sharing a KV head (GQA), so each K/V block is read once per group. Optional
sliding window and tanh logit soft-cap (Gemma 2; a constexpr, so uncapped models
compile without it).

Keys come through each row's page table in the unified pool. Grids are sized from
row and context capacity; dead rows (q_len 0) and splits past a row's context exit.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from loraplex.kernels._jit import MAX, SUM
from loraplex.kernels.paged_kv import PagedRows, check_attention_args, logit_scales, paged_attention_reference
from loraplex.kernels.runtime import (
    KernelLaunch,
    block_default,
    check_blocks,
    check_device,
    interpret_mode,
    kernel_launch,
    next_pow2,
)


@triton.jit
def _decode_split_kernel(q_ptr, kv_ptr, q_start_ptr, q_len_ptr, ctx_ptr, table_ptr, o_ptr, ml_ptr, out_ptr,
                         stride_qt, stride_qh, stride_tr, stride_or, stride_oh, stride_os, stride_ot, stride_oth,
                         page_elems, page_tokens, kv_dim, group, head_dim, window, qk_scale, cap_log2, split_tokens,
                         G_PAD: tl.constexpr, BLOCK_N: tl.constexpr, D_PAD: tl.constexpr,
                         SINGLE: tl.constexpr, PRECISION: tl.constexpr, SOFTCAP: tl.constexpr):
    r = tl.program_id(0)
    kvh = tl.program_id(1)
    sp = tl.program_id(2)
    ctx = tl.load(ctx_ptr + r)
    lo = tl.where(window > 0, tl.maximum(ctx - window, 0), 0)
    s_lo = tl.maximum(sp * split_tokens, lo)
    s_hi = tl.minimum(sp * split_tokens + split_tokens, ctx)
    if (tl.load(q_len_ptr + r) == 0) | (s_lo >= s_hi):
        return
    g = tl.arange(0, G_PAD)
    gmask = g < group
    d = tl.arange(0, D_PAD)
    dmask = d < head_dim
    heads = kvh * group + g  # the query heads reading this KV head
    first = tl.load(q_start_ptr + r)
    q = tl.load(q_ptr + first * stride_qt + heads[:, None] * stride_qh + d[None, :],
                mask=gmask[:, None] & dmask[None, :], other=0.0)  # [G_PAD, D_PAD]
    kv_col = kvh * head_dim + d
    m_i = tl.full([G_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.full([G_PAD], 0.0, dtype=tl.float32)
    acc = tl.full([G_PAD, D_PAD], 0.0, dtype=tl.float32)
    for k0 in range(s_lo, s_hi, BLOCK_N):
        kp = k0 + tl.arange(0, BLOCK_N)
        kmask = kp < s_hi
        page = tl.load(table_ptr + r * stride_tr + kp // page_tokens, mask=kmask, other=0).to(tl.int64)
        base = page * page_elems + (kp % page_tokens) * (2 * kv_dim)
        ld_mask = kmask[:, None] & dmask[None, :]
        k = tl.load(kv_ptr + base[:, None] + kv_col[None, :], mask=ld_mask, other=0.0)
        v = tl.load(kv_ptr + base[:, None] + kv_dim + kv_col[None, :], mask=ld_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # [G_PAD, BLOCK_N], log2 units
        if SOFTCAP:  # s is 2x/ln 2 for x = scale*q.k/softcap: softcap*tanh(x) in log2 units
            s = cap_log2 - 2.0 * cap_log2 / (tl.exp2(s) + 1.0)
        s = tl.where(kmask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.reduce(s, 1, MAX))  # finite: every block holds a valid key
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.reduce(p, 1, SUM)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    if SINGLE:  # one split covers every context: normalise here, no reduction pass
        dst = out_ptr + first * stride_ot + heads[:, None] * stride_oth + d[None, :]
        tl.store(dst, (acc / l_i[:, None]).to(out_ptr.dtype.element_ty), mask=gmask[:, None] & dmask[None, :])
    else:
        part = r * stride_or + heads * stride_oh + sp * stride_os  # [G_PAD] offsets into [R, H, S, D_PAD]
        tl.store(o_ptr + part[:, None] + d[None, :], acc, mask=gmask[:, None])
        tl.store(ml_ptr + 2 * (part // D_PAD), m_i, mask=gmask)
        tl.store(ml_ptr + 2 * (part // D_PAD) + 1, l_i, mask=gmask)


@triton.jit
def _decode_reduce_kernel(o_ptr, ml_ptr, out_ptr, q_start_ptr, q_len_ptr, ctx_ptr,
                          stride_or, stride_oh, stride_os, stride_ot, stride_oth,
                          group, head_dim, window, split_tokens, G_PAD: tl.constexpr, D_PAD: tl.constexpr):
    r = tl.program_id(0)
    kvh = tl.program_id(1)
    if tl.load(q_len_ptr + r) == 0:
        return
    ctx = tl.load(ctx_ptr + r)
    lo = tl.where(window > 0, tl.maximum(ctx - window, 0), 0)
    g = tl.arange(0, G_PAD)
    gmask = g < group
    d = tl.arange(0, D_PAD)
    heads = kvh * group + g
    m = tl.full([G_PAD], float("-inf"), dtype=tl.float32)
    l_sum = tl.full([G_PAD], 0.0, dtype=tl.float32)
    acc = tl.full([G_PAD, D_PAD], 0.0, dtype=tl.float32)
    for sp in range(lo // split_tokens, (ctx + split_tokens - 1) // split_tokens):  # the non-empty splits
        part = r * stride_or + heads * stride_oh + sp * stride_os
        m_s = tl.load(ml_ptr + 2 * (part // D_PAD), mask=gmask, other=0.0)
        l_s = tl.load(ml_ptr + 2 * (part // D_PAD) + 1, mask=gmask, other=0.0)
        o_s = tl.load(o_ptr + part[:, None] + d[None, :], mask=gmask[:, None], other=0.0)
        m_new = tl.maximum(m, m_s)
        a = tl.exp2(m - m_new)
        b = tl.exp2(m_s - m_new)
        acc = acc * a[:, None] + o_s * b[:, None]
        l_sum = l_sum * a + l_s * b
        m = m_new
    o = acc / tl.where(gmask, l_sum, 1.0)[:, None]
    dst = out_ptr + tl.load(q_start_ptr + r) * stride_ot + heads[:, None] * stride_oth + d[None, :]
    tl.store(dst, o.to(out_ptr.dtype.element_ty), mask=gmask[:, None] & (d[None, :] < head_dim))


class DecodeLaunch(NamedTuple):
    split: KernelLaunch  # the split kernel (which normalises itself when there is one split)
    reduce: KernelLaunch | None  # the reduction; None when one split covers every context
    split_tokens: int  # keys per split
    splits: int  # grid axis 2: ceil(max_context / split_tokens)


def decode_launch(*, head_dim: int, group: int, dtype: torch.dtype, index_dtype: torch.dtype, max_context: int,
                  interpreted: bool, split_tokens: int | None = None, block_n: int | None = None,
                  precision: str = "ieee", softcap: bool = False) -> DecodeLaunch:
    """The decode launches for this head size, GQA group, dtype and context capacity (q, the pool
    and out share `dtype`; index_dtype: the row tables'); softcap: the model soft-caps its logits."""
    d_pad = max(16, next_pow2(head_dim))
    g_pad = max(16, next_pow2(group))
    fp32 = dtype == torch.float32  # IEEE float32 dots run on FMA units, their operands held in registers
    # Registers a thread (bench/kernel_compile.py): 16-bit types at 4 warps spill nothing up to head_dim 128
    # and hold 216-224 at 256, which 8 warps share out; float32 spilled at block_n 64 from head_dim 128 on.
    block_n = block_n or min(block_default(32 if fp32 else 64, 256, interpreted), next_pow2(split_tokens or 256))
    warps = 8 if d_pad >= 256 or (fp32 and d_pad >= 128) else 4
    split_tokens = split_tokens or max(block_n, 256)
    if split_tokens % block_n:
        raise ValueError(f"split_tokens={split_tokens} must be a multiple of block_n={block_n}")
    splits = triton.cdiv(max_context, split_tokens)
    rows = {"q_start_ptr": index_dtype, "q_len_ptr": index_dtype, "ctx_ptr": index_dtype}
    split = kernel_launch("paged_attention_decode", "_decode_split_kernel",
                          {"G_PAD": g_pad, "BLOCK_N": block_n, "D_PAD": d_pad, "SINGLE": splits == 1,
                           "PRECISION": precision, "SOFTCAP": softcap},
                          {"q_ptr": dtype, "kv_ptr": dtype, **rows, "table_ptr": index_dtype,
                           "o_ptr": torch.float32, "ml_ptr": torch.float32, "out_ptr": dtype},
                          floats=("qk_scale", "cap_log2"),
                          num_warps=warps)
    reduce = None if splits == 1 else kernel_launch(
        "paged_attention_decode", "_decode_reduce_kernel", {"G_PAD": g_pad, "D_PAD": d_pad},
        {"o_ptr": torch.float32, "ml_ptr": torch.float32, "out_ptr": dtype, **rows})
    return DecodeLaunch(split, reduce, split_tokens, splits)


def paged_decode_attention(q: torch.Tensor, kv: torch.Tensor, rows: PagedRows, *, num_kv_heads: int,
                           page_tokens: int, window: int | None = None, scale: float | None = None,
                           softcap: float | None = None, out: torch.Tensor | None = None,
                           split_tokens: int | None = None, block_n: int | None = None,
                           precision: str = "ieee") -> torch.Tensor:
    """q: [T, H, D]; every live row has q_len 1 (its token at position context-1) -> out [T, H, D].

    split_tokens: keys per split (a multiple of block_n); splits = ceil(max_context / split_tokens).
    softcap: logits become softcap·tanh(scale·q·k / softcap) (None or 0: not capped).
    Keys before the window's first position are never read: their page-table entries may be stale.
    """
    heads, head_dim, group = check_attention_args(q, kv, rows, num_kv_heads, page_tokens)
    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape or out.dtype != q.dtype or out.stride(-1) != 1:
        raise ValueError(f"out must match q {tuple(q.shape)} {q.dtype} with unit last stride")
    device = check_device(q, kv, out, rows.page_table, rows.q_len, kernel=_decode_split_kernel)
    if window is not None and window <= 0:
        raise ValueError(f"window must be positive or None, got {window}")
    if rows.max_q_len > 1:
        raise ValueError(f"decode rows hold one query token each, got max_q_len={rows.max_q_len}")
    qk_scale, cap_log2, capped = logit_scales(scale if scale is not None else 1.0 / math.sqrt(head_dim), softcap)
    choice = decode_launch(head_dim=head_dim, group=group, dtype=q.dtype, index_dtype=rows.page_table.dtype,
                           max_context=rows.max_context, interpreted=interpret_mode(), split_tokens=split_tokens,
                           block_n=block_n, precision=precision, softcap=capped)
    split_tokens = choice.split_tokens
    check_blocks(device, 16, block_n=choice.split.const("BLOCK_N"))
    if rows.num_rows == 0 or rows.max_context == 0:
        return out
    d_pad = choice.split.const("D_PAD")
    single = choice.reduce is None
    partial = torch.empty(rows.num_rows, heads, 1 if single else choice.splits, d_pad, dtype=torch.float32,
                          device=device)
    ml = torch.empty(partial.shape[:3] + (2,), dtype=torch.float32, device=device)
    so = partial.stride()
    _decode_split_kernel[(rows.num_rows, num_kv_heads, choice.splits)](
        q, kv, rows.q_start, rows.q_len, rows.context, rows.page_table, partial, ml, out,
        q.stride(0), q.stride(1), rows.page_table.stride(0), so[0], so[1], so[2], out.stride(0), out.stride(1),
        kv.shape[1], page_tokens, num_kv_heads * head_dim, group, head_dim, window or 0, qk_scale, cap_log2,
        split_tokens, **choice.split.options)
    if choice.reduce is None:
        return out
    _decode_reduce_kernel[(rows.num_rows, num_kv_heads)](
        partial, ml, out, rows.q_start, rows.q_len, rows.context, so[0], so[1], so[2],
        out.stride(0), out.stride(1), group, head_dim, window or 0, split_tokens, **choice.reduce.options)
    return out


paged_decode_reference = paged_attention_reference
