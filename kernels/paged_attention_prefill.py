"""Paged prefill attention: causal, variable-length rows, GQA, optional sliding
window and tanh logit soft-cap (Gemma 2), keys and values read through each row's page table in the unified pool
(flash-attention online softmax, no gather of KV into contiguous buffers).

Grid (query tiles of the longest row capacity, row capacity, heads): dead rows
(q_len 0) and tiles past a row's end exit at once, so the grid is graph safe.
"""
from __future__ import annotations

import math

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
def _prefill_kernel(q_ptr, kv_ptr, out_ptr, q_start_ptr, q_len_ptr, start_pos_ptr, ctx_ptr, table_ptr,
                    stride_qt, stride_qh, stride_ot, stride_oh, stride_tr,
                    page_elems, page_tokens, kv_dim, group, head_dim, window, qk_scale, cap_log2,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D_PAD: tl.constexpr,
                    PRECISION: tl.constexpr, SOFTCAP: tl.constexpr):
    mt = tl.program_id(0)
    r = tl.program_id(1)
    h = tl.program_id(2)
    q_len = tl.load(q_len_ptr + r)
    if mt * BLOCK_M >= q_len:
        return
    first = tl.load(q_start_ptr + r)
    p0 = tl.load(start_pos_ptr + r)
    ctx = tl.load(ctx_ptr + r)
    i = mt * BLOCK_M + tl.arange(0, BLOCK_M)
    imask = i < q_len
    q_pos = p0 + i
    d = tl.arange(0, D_PAD)
    dmask = d < head_dim
    q = tl.load(q_ptr + (first + i)[:, None] * stride_qt + h * stride_qh + d[None, :],
                mask=imask[:, None] & dmask[None, :], other=0.0)
    kv_col = (h // group) * head_dim + d  # this head's K columns; V sits kv_dim further
    hi = tl.minimum(ctx, p0 + tl.minimum((mt + 1) * BLOCK_M, q_len))  # causal: keys up to the tile's last query
    lo = tl.where(window > 0, tl.maximum(p0 + mt * BLOCK_M - window + 1, 0), 0)  # sliding window: oldest key
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, dtype=tl.float32)
    acc = tl.full([BLOCK_M, D_PAD], 0.0, dtype=tl.float32)
    for k0 in range(lo, hi, BLOCK_N):
        kp = k0 + tl.arange(0, BLOCK_N)
        kmask = kp < hi
        page = tl.load(table_ptr + r * stride_tr + kp // page_tokens, mask=kmask, other=0).to(tl.int64)
        base = page * page_elems + (kp % page_tokens) * (2 * kv_dim)
        ld_mask = kmask[:, None] & dmask[None, :]
        k = tl.load(kv_ptr + base[:, None] + kv_col[None, :], mask=ld_mask, other=0.0)
        v = tl.load(kv_ptr + base[:, None] + kv_dim + kv_col[None, :], mask=ld_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N], log2 units
        if SOFTCAP:  # s is 2x/ln 2 for x = scale*q.k/softcap: softcap*tanh(x) in log2 units
            s = cap_log2 - 2.0 * cap_log2 / (tl.exp2(s) + 1.0)
        allowed = (kp[None, :] <= q_pos[:, None]) & kmask[None, :]
        allowed = allowed & ((window <= 0) | (q_pos[:, None] - kp[None, :] < window))
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.reduce(s, 1, MAX))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a query with no key yet in this block
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.reduce(p, 1, SUM)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    o = acc / l_safe[:, None]
    tl.store(out_ptr + (first + i)[:, None] * stride_ot + h * stride_oh + d[None, :], o.to(out_ptr.dtype.element_ty),
             mask=imask[:, None] & dmask[None, :])


def prefill_launch(*, head_dim: int, dtype: torch.dtype, index_dtype: torch.dtype, interpreted: bool,
                   block_m: int | None = None, block_n: int | None = None, precision: str = "ieee",
                   softcap: bool = False) -> KernelLaunch:
    """The prefill launch for this head size and dtype (q, the pool and out share `dtype`;
    index_dtype: the row tables'); softcap: the model soft-caps its logits."""
    d_pad = max(16, next_pow2(head_dim))
    # Registers a thread (bench/kernel_compile.py): IEEE float32 dots run on FMA units with their operands
    # in registers; 64 x 64 tiles spilled 17-35 KB a thread there (and head_dim 256 overflowed sm_80's shared
    # memory), 32 x 32 on 8 warps spill at most 252 B. 16-bit head_dim 256 spilled on 4 warps.
    fp32 = dtype == torch.float32 and not interpreted
    block_m = block_m or (32 if fp32 else 64)
    block_n = block_n or (32 if fp32 else block_default(64, 128, interpreted))
    warps = 8 if fp32 or d_pad >= 256 else 4
    return kernel_launch("paged_attention_prefill", "_prefill_kernel",
                         {"BLOCK_M": block_m, "BLOCK_N": block_n, "D_PAD": d_pad, "PRECISION": precision,
                          "SOFTCAP": softcap},
                         {"q_ptr": dtype, "kv_ptr": dtype, "out_ptr": dtype, "q_start_ptr": index_dtype,
                          "q_len_ptr": index_dtype, "start_pos_ptr": index_dtype, "ctx_ptr": index_dtype,
                          "table_ptr": index_dtype}, floats=("qk_scale", "cap_log2"),
                         num_warps=warps)


def paged_prefill_attention(q: torch.Tensor, kv: torch.Tensor, rows: PagedRows, *, num_kv_heads: int,
                            page_tokens: int, window: int | None = None, scale: float | None = None,
                            softcap: float | None = None, out: torch.Tensor | None = None,
                            block_m: int | None = None, block_n: int | None = None,
                            precision: str = "ieee") -> torch.Tensor:
    """q: [T, H, D] (RoPE applied), kv: one pool layer [num_pages, page_elems] -> out [T, H, D].

    Only tokens covered by a live row are written (out may be shared with the decode kernel).
    softcap: logits become softcap·tanh(scale·q·k / softcap) (None or 0: not capped). Keys before
    the window of a row's first query are never read: their page-table entries may be stale.
    """
    heads, head_dim, group = check_attention_args(q, kv, rows, num_kv_heads, page_tokens)
    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape or out.dtype != q.dtype or out.stride(-1) != 1:
        raise ValueError(f"out must match q {tuple(q.shape)} {q.dtype} with unit last stride")
    device = check_device(q, kv, out, rows.page_table, rows.q_len, kernel=_prefill_kernel)
    if window is not None and window <= 0:
        raise ValueError(f"window must be positive or None, got {window}")
    qk_scale, cap_log2, capped = logit_scales(scale if scale is not None else 1.0 / math.sqrt(head_dim), softcap)
    launch = prefill_launch(head_dim=head_dim, dtype=q.dtype, index_dtype=rows.page_table.dtype,
                            interpreted=interpret_mode(), block_m=block_m, block_n=block_n, precision=precision,
                            softcap=capped)
    block_m = launch.const("BLOCK_M")
    check_blocks(device, 16, block_m=block_m, block_n=launch.const("BLOCK_N"))
    if rows.num_rows == 0 or rows.max_q_len == 0:
        return out
    grid = (triton.cdiv(rows.max_q_len, block_m), rows.num_rows, heads)
    _prefill_kernel[grid](q, kv, out, rows.q_start, rows.q_len, rows.start_pos, rows.context, rows.page_table,
                          q.stride(0), q.stride(1), out.stride(0), out.stride(1), rows.page_table.stride(0),
                          kv.shape[1], page_tokens, num_kv_heads * head_dim, group, head_dim, window or 0,
                          qk_scale, cap_log2, **launch.options)
    return out


paged_prefill_reference = paged_attention_reference
