"""Paged prefill and flash-decoding kernels against the torch reference: GQA,
odd head_dim, shuffled pages, chunked prefill (start_pos > 0), sliding window,
several decode splits, dead capacity rows; and `TritonPagedAttention` against
`TorchPagedAttention` on the unified pool.

Runs on CPU under TRITON_INTERPRET=1 (set before triton is imported).
"""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the first import of triton
pytest.importorskip("triton")

from loraplex.contracts.geometry import PageGeometry  # noqa: E402
from loraplex.gpu_engine.model.attention_torch import TorchPagedAttention  # noqa: E402
from loraplex.gpu_engine.model.attention_triton import TritonPagedAttention  # noqa: E402
from loraplex.gpu_engine.model.batch import ForwardBatch, RowSpan  # noqa: E402
from loraplex.gpu_engine.pool import UnifiedPool  # noqa: E402
from loraplex.kernels.paged_attention_decode import paged_decode_attention  # noqa: E402
from loraplex.kernels.paged_attention_prefill import paged_prefill_attention  # noqa: E402
from loraplex.kernels.paged_kv import build_rows, paged_attention_reference  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PT, KVH, D, H = 4, 2, 12, 6  # page_tokens, kv heads, odd head_dim, GQA group of 3
# Tiles fed to tl.dot are >= 16 on a GPU (the launchers refuse less there); the interpreter takes 4,
# which puts several tiles in these short rows.
BLOCK = 16 if DEVICE == "cuda" else 4


def paged_case(seed: int, rows: list[tuple[int, int]], num_pages: int = 48):
    """rows: (q_len, start_pos). Pages of each row drawn from a shuffled pool -> q, kv, spans."""
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(num_pages, PT * 2 * KVH * D, generator=g)
    free = torch.randperm(num_pages, generator=g).tolist()
    spans, first = [], 0
    for count, start in rows:
        n_pages = -(-(start + count) // PT)
        spans.append((first, count, start, [free.pop() for _ in range(n_pages)]))
        first += count
    q = torch.randn(first, H, D, generator=g)
    return q.to(DEVICE), kv.to(DEVICE), spans


@pytest.mark.parametrize("window", [None, 5])
def test_prefill_matches_reference(window: int | None) -> None:
    # a fresh prompt, a chunk continuing at position 9, a single token, one more row
    q, kv, spans = paged_case(1, [(7, 0), (13, 9), (1, 6), (3, 0)])
    rows = build_rows(spans, DEVICE, capacity_rows=6, max_q_len=16)  # two dead rows, spare query tiles
    out = paged_prefill_attention(q, kv, rows, num_kv_heads=KVH, page_tokens=PT, window=window, block_m=BLOCK,
                                  block_n=BLOCK)
    want = paged_attention_reference(q, kv, rows, KVH, PT, window)
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("window", [None, 7])
def test_decode_matches_reference_across_splits(window: int | None) -> None:
    q, kv, spans = paged_case(2, [(1, 0), (1, 9), (1, 37), (1, 20), (1, 5)], num_pages=64)
    rows = build_rows(spans, DEVICE, capacity_rows=7, max_context=48)
    want = paged_attention_reference(q, kv, rows, KVH, PT, window)
    for split_tokens in (2 * BLOCK, 64):  # several splits + reduction, then a single split (no reduction pass)
        out = paged_decode_attention(q, kv, rows, num_kv_heads=KVH, page_tokens=PT, window=window,
                                     split_tokens=split_tokens, block_n=BLOCK)
        torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-4)


def test_attention_launchers_reject_bad_arguments() -> None:
    q, kv, spans = paged_case(3, [(1, 4)])
    rows = build_rows(spans, DEVICE)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        paged_decode_attention(q, kv, rows, num_kv_heads=4, page_tokens=PT)
    with pytest.raises(ValueError, match="kv must have size"):
        paged_decode_attention(q, kv, rows, num_kv_heads=KVH, page_tokens=PT * 2)
    with pytest.raises(ValueError, match="multiple of block_n"):
        paged_decode_attention(q, kv, rows, num_kv_heads=KVH, page_tokens=PT, split_tokens=2 * BLOCK + 2,
                               block_n=BLOCK)
    with pytest.raises(ValueError, match="kv must have dtype"):
        paged_prefill_attention(q, kv.half(), rows, num_kv_heads=KVH, page_tokens=PT)
    many = build_rows(paged_case(3, [(3, 0)])[2], DEVICE)
    with pytest.raises(ValueError, match="one query token"):
        paged_decode_attention(q, kv, many, num_kv_heads=KVH, page_tokens=PT)


@pytest.mark.parametrize("window", [None, 6])
def test_triton_attention_backend_matches_torch(window: int | None) -> None:
    """A mixed step on the unified pool: prefill chunks and decode rows, K/V written through page tables."""
    geometry = PageGeometry(kv_dim=KVH * D, page_tokens=PT, max_row_width=KVH * D)
    pool = UnifiedPool(1, 40, geometry, device=torch.device(DEVICE), dtype=torch.float32)
    g = torch.Generator().manual_seed(4)
    pool.data.copy_(torch.randn(pool.data.shape, generator=g))
    free = torch.randperm(40, generator=g).tolist()
    spans: list[RowSpan] = []
    first = 0
    for count, start in [(1, 17), (9, 0), (1, 3), (5, 8)]:
        ctx = start + count
        pages = torch.tensor([free.pop() for _ in range(-(-ctx // PT))], device=DEVICE)
        spans.append(RowSpan(first=first, count=count, start_pos=start, context=ctx, pages=pages))
        first += count
    empty = torch.zeros(0, dtype=torch.int64, device=DEVICE)
    batch = ForwardBatch(token_ids=empty, positions=empty, kv_page_ids=empty, kv_slots=empty, rows=spans,
                         sample_tokens=empty, lora_groups=[])
    q = torch.randn(first, H, D, generator=g).to(DEVICE)
    want = TorchPagedAttention(H, KVH, D, (window,)).forward(q, 0, batch, pool)
    got = TritonPagedAttention(H, KVH, D, (window,)).forward(q, 0, batch, pool)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
