"""Kernels at full size on a CUDA device, in half precision: hidden 4096, batch
64, ranks 8-128, fused q/k/v widths, long paged contexts. Compared with the
float32 torch references on the same (rounded) inputs. Skipped without CUDA.
"""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu
pytest.importorskip("triton")

from bench import gpu_parity  # noqa: E402
from loraplex.kernels import lora_bgmv, lora_mbgmv, lora_sgmv  # noqa: E402
from loraplex.kernels.paged_attention_decode import paged_decode_attention  # noqa: E402
from loraplex.kernels.paged_attention_prefill import paged_prefill_attention  # noqa: E402
from loraplex.kernels.paged_kv import build_rows, paged_attention_reference  # noqa: E402

DTYPE = torch.bfloat16
HIDDEN, KV = 4096, 1024
RANKS = [8, 16, 32, 64, 128]


def lora_case(batch: int, dtype: torch.dtype = DTYPE):
    return gpu_parity.lora_case(batch, device="cuda", dtype=dtype, hidden=HIDDEN, ranks=RANKS)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("kind", ["bgmv", "mbgmv"])
def test_gemv_full_size(kind: str, dtype: torch.dtype) -> None:
    x, flat, tables = lora_case(64, dtype)
    slot = torch.arange(64, dtype=torch.int32, device="cuda")
    slot[::7] = -1  # base rows
    outs = [torch.randn(64, n, device="cuda").to(dtype) for n in (HIDDEN, KV, KV)]
    want = [o.float() for o in outs]
    lora_bgmv.bgmv_reference(want, x.float(), flat.float(), slot, tables)
    mod = lora_bgmv if kind == "bgmv" else lora_mbgmv
    y = getattr(mod, f"{kind}_shrink")(x, flat, slot, tables)
    getattr(mod, f"{kind}_expand")(outs, y, flat, slot, tables)
    for got, ref in zip(outs, want):
        torch.testing.assert_close(got.float(), ref, rtol=2e-2, atol=2e-2)


def test_sgmv_full_size() -> None:
    x, flat, tables = lora_case(5)
    x = x.repeat_interleave(100, 0)  # 5 segments x 100 tokens, ranks 8..128
    i32 = dict(dtype=torch.int32, device="cuda")
    start, length, slot = torch.arange(5, **i32) * 100, torch.full((5,), 100, **i32), torch.arange(5, **i32)
    outs = [torch.randn(500, n, device="cuda").to(DTYPE) for n in (HIDDEN, KV, KV)]
    want = [o.float() for o in outs]
    lora_sgmv.sgmv_reference(want, x.float(), flat.float(), start, length, slot, tables)
    y = lora_sgmv.sgmv_shrink(x, flat, start, length, slot, tables, 100)
    lora_sgmv.sgmv_expand(outs, y, flat, start, length, slot, tables, 100)
    for got, ref in zip(outs, want):
        torch.testing.assert_close(got.float(), ref, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("window", [None, 1000])
def test_paged_attention_full_size(window: int | None) -> None:
    pt, heads, kv_heads, d = 16, 32, 8, 128
    g = torch.Generator().manual_seed(0)
    contexts = [3000, 17, 1500, 4096]
    pages = torch.randperm(sum(-(-c // pt) for c in contexts), generator=g).tolist()
    kv = torch.randn(len(pages), pt * 2 * kv_heads * d, generator=g).to("cuda", DTYPE)
    decode = build_rows([(i, 1, c - 1, [pages.pop() for _ in range(-(-c // pt))]) for i, c in enumerate(contexts)],
                        "cuda")
    q = torch.randn(len(contexts), heads, d, generator=g).to("cuda", DTYPE)
    got = paged_decode_attention(q, kv, decode, num_kv_heads=kv_heads, page_tokens=pt, window=window)
    want = paged_attention_reference(q.float(), kv.float(), decode, kv_heads, pt, window)
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)
    table = decode.page_table[3].tolist()
    prefill = build_rows([(0, 300, 1000, table[:82]), (300, 77, 0, table[:5])], "cuda")
    q = torch.randn(377, heads, d, generator=g).to("cuda", DTYPE)
    got = paged_prefill_attention(q, kv, prefill, num_kv_heads=kv_heads, page_tokens=pt, window=window)
    want = paged_attention_reference(q.float(), kv.float(), prefill, kv_heads, pt, window)
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)
