"""The engine's input domain for the Triton kernels, declared once, and every distinct
compile the launchers choose over it.

The launches come from the launchers' own choice functions (`*_launch` beside each
kernel), never from a second list of tile sizes: this module only says which sizes,
dtypes and batch shapes the engine can hand them. Imports no triton at module level;
`kernels/compile_check.py` compiles what `distinct_launches` returns.
"""
from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence

import torch

from loraplex.contracts.engine_spec import DEFAULT_MAX_NUM_SEQS
from loraplex.contracts.geometry import DEFAULT_PAGE_TOKENS
from loraplex.kernels.runtime import KernelLaunch

DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # EngineSpec.dtype: float16, bfloat16 (CUDA default), float32
INDEX_DTYPE = torch.int32  # every slot, segment, row and page table the engine builds
# Llama-family heads: 64 (Llama-3.2-1B), 80 (Phi-2), 96 (Phi-3-mini), 112, 128 (Llama 2/3, Mistral, Qwen2.5-7B),
# 256 (Gemma); the launchers pad to a power of two
HEAD_DIMS = (64, 80, 96, 112, 128, 256)
GQA_GROUPS = (1, 2, 3, 4, 5, 6, 7, 8, 16)  # 16: Llama-3.1-405B; 3, 5, 6, 7: Llama-3.2-3B and Qwen2.5 sizes
# the batch's largest adapter rank (BGMV, MBGMV eager, SGMV) or max_lora_rank itself (MBGMV in decode graphs):
# powers of two and the odd ranks between them, 8 .. 256 (EngineSpec.max_lora_rank defaults to 256)
LORA_RANKS = (8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)
# in_features of the target modules (hidden size, heads x head_dim, MLP width) of the models above, TP 1:
# from Qwen2.5-0.5B's 896 to an MLP's 24576
IN_FEATURES = (896, 1024, 1536, 2048, 2560, 3072, 3584, 4096, 5120, 8192, 11008, 14336, 18944, 24576)
# out_features of the widest module in one launch: also a lone k_proj or v_proj (2 KV heads x 64 = 128)
OUT_FEATURES = (128, 256, 512, 896, 1024, 2048, 3072, 4096, 5120, 8192, 11008, 14336, 18944, 24576)
MODULES_PER_LAUNCH = (1, 2, 3)  # o/down alone, gate+up, q+k+v (MAX_FUSED_MODULES)
# tokens in a decode launch: CUDA-graph buckets 1, 2, 4, ... max_num_seqs and any eager batch between.
# They choose the shrink's split count, a runtime argument: no compile depends on them today.
DECODE_TOKENS = (1, 2, 3, 8, 42, DEFAULT_MAX_NUM_SEQS, 100, 128, 256)
DECODE_SPLIT_TOKENS = (256,)  # gpu_engine TritonPagedAttention's DEFAULT_SPLIT_TOKENS (a test checks it)
PAGE_TOKENS = (DEFAULT_PAGE_TOKENS, 32, 64, 128)  # a runtime int in every kernel: multiples of 16 only
PRECISIONS = ("ieee",)  # the engine never passes another; tf32 and tf32x3 are bench knobs
# attention logit soft-capping (ModelConfig.attn_softcap: Gemma 2, head dims 128 and 256) is a constexpr of the
# prefill and decode-split kernels: every model without it compiles the uncapped variant
SOFTCAPS = (False, True)
# No launcher has autotune candidates: every tile size comes from the choice functions alone.

# Runtime ints that are multiples of 16 at every engine launch, as Triton specialises them
# (tt.divisibility=16) on a GPU: hidden sizes, head dims and page_tokens are, and so are the
# strides of contiguous [tokens, heads * head_dim] and [tokens, features] tensors. Other ints
# (slot counts, rank widths, page-table widths, GQA groups) vary and compile without it; an
# int equal to 1 (group 1, one adapter) becomes a constant there, which this check leaves out.
DIVISIBLE_INTS: dict[str, tuple[str, ...]] = {
    "_gemv_shrink_kernel": ("K", "stride_xt"),
    "_gemv_expand_kernel": ("n0", "n1", "n2", "so0", "so1", "so2"),
    "_sgmv_shrink_kernel": ("K", "stride_xt"),
    "_sgmv_expand_kernel": ("n0", "n1", "n2", "so0", "so1", "so2"),
    "_prefill_kernel": ("stride_qt", "stride_qh", "stride_ot", "stride_oh", "page_elems", "page_tokens", "kv_dim",
                        "head_dim", "window"),
    "_decode_split_kernel": ("stride_qt", "stride_qh", "stride_or", "stride_oh", "stride_os", "stride_ot",
                             "stride_oth", "page_elems", "page_tokens", "kv_dim", "head_dim", "window",
                             "split_tokens"),
    "_decode_reduce_kernel": ("stride_or", "stride_oh", "stride_os", "stride_ot", "stride_oth", "head_dim", "window",
                              "split_tokens"),
}


def _gemv(dtype: torch.dtype) -> Iterator[KernelLaunch]:
    from loraplex.kernels.lora_gemv import gemv_expand_launch, gemv_shrink_launch

    for padded in (True, False):  # BGMV, MBGMV
        for rank in LORA_RANKS:
            for k in IN_FEATURES:
                for tokens in DECODE_TOKENS:
                    for modules in MODULES_PER_LAUNCH:
                        yield gemv_shrink_launch(max_rank=rank, padded=padded, in_features=k, tokens=tokens,
                                                 num_modules=modules, x_dtype=dtype, flat_dtype=dtype,
                                                 index_dtype=INDEX_DTYPE, interpreted=False)[0]
            for n in OUT_FEATURES:
                yield gemv_expand_launch(max_rank=rank, padded=padded, max_out=n, flat_dtype=dtype, out_dtype=dtype,
                                         index_dtype=INDEX_DTYPE, interpreted=False)


def _sgmv(dtype: torch.dtype) -> Iterator[KernelLaunch]:
    from loraplex.kernels.lora_sgmv import sgmv_expand_launch, sgmv_shrink_launch

    for precision in PRECISIONS:
        for rank in LORA_RANKS:
            for k in IN_FEATURES:
                yield sgmv_shrink_launch(max_rank=rank, in_features=k, dtype=dtype, index_dtype=INDEX_DTYPE,
                                         interpreted=False, precision=precision)
            for n in OUT_FEATURES:
                yield sgmv_expand_launch(max_rank=rank, max_out=n, flat_dtype=dtype, out_dtype=dtype,
                                         index_dtype=INDEX_DTYPE, interpreted=False, precision=precision)


def _attention(dtype: torch.dtype) -> Iterator[KernelLaunch]:
    from loraplex.kernels.paged_attention_decode import decode_launch
    from loraplex.kernels.paged_attention_prefill import prefill_launch

    for precision, softcap, head_dim in itertools.product(PRECISIONS, SOFTCAPS, HEAD_DIMS):
        yield prefill_launch(head_dim=head_dim, dtype=dtype, index_dtype=INDEX_DTYPE, interpreted=False,
                             precision=precision, softcap=softcap)
        for group in GQA_GROUPS:
            for split_tokens in DECODE_SPLIT_TOKENS:
                # contexts of one split (no reduction) and of several
                for max_context in (1, split_tokens, split_tokens + 1, 32 * split_tokens):
                    choice = decode_launch(head_dim=head_dim, group=group, dtype=dtype, index_dtype=INDEX_DTYPE,
                                           max_context=max_context, interpreted=False, split_tokens=split_tokens,
                                           precision=precision, softcap=softcap)
                    yield choice.split
                    if choice.reduce is not None:
                        yield choice.reduce


def engine_launches(dtypes: Sequence[torch.dtype] = DTYPES) -> Iterator[KernelLaunch]:
    """Every launch the engine can make on a GPU over the domain above, repeats included."""
    for dtype in dtypes:
        yield from _gemv(dtype)
        yield from _sgmv(dtype)
        yield from _attention(dtype)


def distinct_launches(dtypes: Sequence[torch.dtype] = DTYPES) -> list[KernelLaunch]:
    """engine_launches without repeats (a KernelLaunch is its compile key), in first-seen order."""
    return list(dict.fromkeys(engine_launches(dtypes)))


def launch_name(launch: KernelLaunch) -> str:
    """A short stable name: kernel, element type and constexprs, e.g.
    `_decode_split_kernel bf16 G_PAD=16 BLOCK_N=64 D_PAD=128 SINGLE=False PRECISION=ieee SOFTCAP=False`."""
    types = dict(launch.types)
    elem = next(types[p][1:] for p in ("flat_ptr", "kv_ptr", "out_ptr") if p in types)  # the model's dtype
    consts = " ".join(f"{k}={v}" for k, v in launch.constexprs)
    extra = "" if (launch.num_warps, launch.num_stages) == (4, 3) else \
        f" num_warps={launch.num_warps} num_stages={launch.num_stages}"
    return f"{launch.kernel} {elem} {consts}{extra}"
