"""Paged prefill and flash-decoding kernels against the torch reference: GQA,
odd head_dim, shuffled pages, chunked prefill (start_pos > 0), sliding window,
several decode splits, dead capacity rows, tanh soft-capped logits (Gemma 2),
head_dim 256; and `TritonPagedAttention` against `TorchPagedAttention` on the
unified pool (per-layer windows, soft-cap, a non-default q·k scale).

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
from tests.tolerances import assert_within, attention_bound  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PT, KVH, D, H = 4, 2, 12, 6  # page_tokens, kv heads, odd head_dim, GQA group of 3
# Tiles fed to tl.dot are >= 16 on a GPU (the launchers refuse less there); the interpreter takes 4,
# which puts several tiles in these short rows.
BLOCK = 16 if DEVICE == "cuda" else 4


def paged_case(seed: int, rows: list[tuple[int, int]], num_pages: int = 48, *, heads: int = H, kv_heads: int = KVH,
               head_dim: int = D):
    """rows: (q_len, start_pos). Pages of each row drawn from a shuffled pool -> q, kv, spans."""
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(num_pages, PT * 2 * kv_heads * head_dim, generator=g)
    free = torch.randperm(num_pages, generator=g).tolist()
    spans, first = [], 0
    for count, start in rows:
        n_pages = -(-(start + count) // PT)
        spans.append((first, count, start, [free.pop() for _ in range(n_pages)]))
        first += count
    q = torch.randn(first, heads, head_dim, generator=g)
    return q.to(DEVICE), kv.to(DEVICE), spans


def check_attention(out: torch.Tensor, want: torch.Tensor, q: torch.Tensor, kv: torch.Tensor, rows, window=None,
                    softcap=None, scale=None, what: str = "") -> None:
    """out against the float32 reference within attention_bound: the reference's softmax over |V| gives
    each output element's weighted |V|, the largest key norm the scores' error."""
    head_dim = q.shape[2]
    kv_heads = kv.shape[1] // (PT * 2 * head_dim)
    entries = kv.view(kv.shape[0], PT, 2, kv_heads, head_dim)
    abs_v = entries.clone()
    abs_v[:, :, 1] = abs_v[:, :, 1].abs()
    weighted = paged_attention_reference(q, abs_v.view_as(kv), rows, kv_heads, PT, window, scale, softcap)
    bound = attention_bound(q, weighted, k_norm_max=float(entries[:, :, 0].norm(dim=-1).max()),
                            scale=scale if scale is not None else head_dim ** -0.5, context=int(rows.context.max()))
    assert_within(out, want, bound, what)


def check_pool_attention(got: torch.Tensor, want: torch.Tensor, q: torch.Tensor, pool, batch, scale=None,
                         what: str = "") -> None:
    """Two attention backends over the unified pool: |V| and the key norms bounded by the pool's largest value."""
    largest = float(pool.data.abs().max())
    head_dim = q.shape[-1]
    bound = attention_bound(q, largest, k_norm_max=largest * head_dim ** 0.5,
                            scale=scale if scale is not None else head_dim ** -0.5,
                            context=max(r.context for r in batch.rows))
    assert_within(got, want, bound, what)


def fresh_seed() -> int:
    return int(torch.randint(1 << 30, ()))  # fresh inputs every run; tests name it when they fail


@pytest.mark.parametrize("window", [None, 5])
def test_prefill_matches_reference(window: int | None) -> None:
    # a fresh prompt, a chunk continuing at position 9, a single token, one more row
    q, kv, spans = paged_case(1, [(7, 0), (13, 9), (1, 6), (3, 0)])
    rows = build_rows(spans, DEVICE, capacity_rows=6, max_q_len=16)  # two dead rows, spare query tiles
    out = paged_prefill_attention(q, kv, rows, num_kv_heads=KVH, page_tokens=PT, window=window, block_m=BLOCK,
                                  block_n=BLOCK)
    want = paged_attention_reference(q, kv, rows, KVH, PT, window)
    check_attention(out, want, q, kv, rows, window)


@pytest.mark.parametrize("window", [None, 7])
def test_decode_matches_reference_across_splits(window: int | None) -> None:
    q, kv, spans = paged_case(2, [(1, 0), (1, 9), (1, 37), (1, 20), (1, 5)], num_pages=64)
    rows = build_rows(spans, DEVICE, capacity_rows=7, max_context=48)
    want = paged_attention_reference(q, kv, rows, KVH, PT, window)
    for split_tokens in (2 * BLOCK, 64):  # several splits + reduction, then a single split (no reduction pass)
        out = paged_decode_attention(q, kv, rows, num_kv_heads=KVH, page_tokens=PT, window=window,
                                     split_tokens=split_tokens, block_n=BLOCK)
        check_attention(out, want, q, kv, rows, window, what=f"split {split_tokens}: ")


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


def _pool_step(seed: int, rows: list[tuple[int, int]], *, kv_heads: int, head_dim: int, layers: int):
    """A unified pool of `layers` random layers and one step's RowSpans over shuffled pages."""
    geometry = PageGeometry(kv_dim=kv_heads * head_dim, page_tokens=PT, max_row_width=kv_heads * head_dim)
    pool = UnifiedPool(layers, 40, geometry, device=torch.device(DEVICE), dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    pool.data.copy_(torch.randn(pool.data.shape, generator=g))
    free = torch.randperm(39, generator=g).tolist()  # page 39 is no row's, as the engine's scratch page
    spans: list[RowSpan] = []
    first = 0
    for count, start in rows:
        ctx = start + count
        pages = torch.tensor([free.pop() for _ in range(-(-ctx // PT))], device=DEVICE)
        spans.append(RowSpan(first=first, count=count, start_pos=start, context=ctx, pages=pages))
        first += count
    empty = torch.zeros(0, dtype=torch.int64, device=DEVICE)
    batch = ForwardBatch(token_ids=empty, positions=empty, kv_page_ids=empty, kv_slots=empty, rows=spans,
                         sample_tokens=empty, lora_groups=[])
    return pool, batch, g, first


@pytest.mark.parametrize("window", [None, 6])
def test_triton_attention_backend_matches_torch(window: int | None) -> None:
    """A mixed step on the unified pool: prefill chunks and decode rows, K/V written through page tables."""
    pool, batch, g, tokens = _pool_step(4, [(1, 17), (9, 0), (1, 3), (5, 8)], kv_heads=KVH, head_dim=D, layers=1)
    q = torch.randn(tokens, H, D, generator=g).to(DEVICE)
    want = TorchPagedAttention(H, KVH, D, (window,)).forward(q, 0, batch, pool)
    got = TritonPagedAttention(H, KVH, D, (window,)).forward(q, 0, batch, pool)
    check_pool_attention(got, want, q, pool, batch)


# ---- soft-capped logits (Gemma 2), per-layer windows, head_dim 256 ---------------------------------
CAP = 1.5  # logits here are about N(0, 1) (scale 1/sqrt(D)): a cap this low bends most of them


@pytest.mark.parametrize("head_dim, window", [(D, None), (D, 5), (256, 6)])
def test_softcapped_kernels_match_reference(head_dim: int, window: int | None) -> None:
    seed = fresh_seed()
    q, kv, spans = paged_case(seed, [(7, 0), (9, 6), (3, 0)], head_dim=head_dim)
    rows = build_rows(spans, DEVICE, capacity_rows=4)
    want = paged_attention_reference(q, kv, rows, KVH, PT, window, softcap=CAP)
    uncapped = paged_attention_reference(q, kv, rows, KVH, PT, window)
    assert (want - uncapped).abs().max() > 1e-2, "the cap must change the output for this test to mean anything"
    out = paged_prefill_attention(q, kv, rows, num_kv_heads=KVH, page_tokens=PT, window=window, softcap=CAP,
                                  block_m=BLOCK, block_n=BLOCK)
    check_attention(out, want, q, kv, rows, window, CAP, what=f"prefill, seed {seed}: ")
    q, kv, spans = paged_case(seed, [(1, 0), (1, 9), (1, 21), (1, 14)], head_dim=head_dim)
    rows = build_rows(spans, DEVICE, capacity_rows=5)
    want = paged_attention_reference(q, kv, rows, KVH, PT, window, softcap=CAP)
    for split_tokens in (2 * BLOCK, 64):  # several splits + reduction, then one split
        out = paged_decode_attention(q, kv, rows, num_kv_heads=KVH, page_tokens=PT, window=window, softcap=CAP,
                                     split_tokens=split_tokens, block_n=BLOCK)
        check_attention(out, want, q, kv, rows, window, CAP, what=f"decode split {split_tokens}, seed {seed}: ")


def test_softcap_zero_is_off_and_bad_caps_are_refused() -> None:
    q, kv, spans = paged_case(fresh_seed(), [(5, 3)])
    rows = build_rows(spans, DEVICE)
    args = dict(num_kv_heads=KVH, page_tokens=PT, block_m=BLOCK, block_n=BLOCK)
    torch.testing.assert_close(paged_prefill_attention(q, kv, rows, softcap=0.0, **args),
                               paged_prefill_attention(q, kv, rows, **args), rtol=0, atol=0)
    for bad in (-1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="softcap"):
            paged_prefill_attention(q, kv, rows, softcap=bad, **args)
        with pytest.raises(ValueError, match="softcap"):
            TritonPagedAttention(H, KVH, D, (None,), softcap=bad)


@pytest.mark.parametrize("heads, kv_heads, head_dim", [(H, KVH, D), (4, 2, 256)])
def test_triton_backend_softcap_and_layer_windows_match_torch(heads: int, kv_heads: int, head_dim: int) -> None:
    """Gemma-2-like attention: a sliding layer (window shorter than the contexts) and a global one,
    soft-capped logits, a non-default q·k scale, GQA; prefill chunks and decode rows in one step."""
    seed = fresh_seed()
    pool, batch, g, tokens = _pool_step(seed, [(1, 17), (9, 0), (1, 3), (5, 8), (1, 11)], kv_heads=kv_heads,
                                        head_dim=head_dim, layers=2)
    q = torch.randn(tokens, heads, head_dim, generator=g).to(DEVICE)
    windows, scale = (4, None), 1.3 / head_dim ** 0.5  # query_pre_attn_scalar-style scale
    torch_attn = TorchPagedAttention(heads, kv_heads, head_dim, windows, scale=scale, softcap=CAP)
    triton_attn = TritonPagedAttention(heads, kv_heads, head_dim, windows, scale=scale, softcap=CAP)
    uncapped = TorchPagedAttention(heads, kv_heads, head_dim, windows, scale=scale)
    for layer in (0, 1):
        want = torch_attn.forward(q, layer, batch, pool)
        assert (want - uncapped.forward(q, layer, batch, pool)).abs().max() > 1e-2
        check_pool_attention(triton_attn.forward(q, layer, batch, pool), want, q, pool, batch, scale,
                             f"layer {layer}, seed {seed}: ")


# ---- pages before the window are never read (sliding-window KV release) ------------------------------
def test_no_path_reads_a_page_wholly_before_the_window() -> None:
    """A sliding-window model gives pages wholly before a row's window back to the pool, leaving
    placeholders in its page table (daemon/scheduler/kv_pages.py): point those entries at a page of
    NaNs and every path (prefill, decode, the torch reference's pool read) must give the same output."""
    seed, window = fresh_seed(), 6
    pool, batch, g, tokens = _pool_step(seed, [(1, 21), (9, 8), (1, 13), (5, 14)], kv_heads=KVH, head_dim=D,
                                        layers=1)
    q = torch.randn(tokens, H, D, generator=g).to(DEVICE)
    for attn in (TorchPagedAttention(H, KVH, D, (window,), softcap=CAP),
                 TritonPagedAttention(H, KVH, D, (window,), softcap=CAP)):
        want = attn.forward(q, 0, batch, pool)
        poisoned = pool.data[0, -1].clone()
        pool.data[0, -1] = float("nan")  # the last page is no row's: the placeholder
        rows = [RowSpan(r.first, r.count, r.start_pos, r.context, r.pages.clone()) for r in batch.rows]
        for r in rows:
            out = max(0, r.start_pos - window + 1) // PT  # pages wholly before the first query's window
            r.pages[:out] = pool.num_pages - 1
        assert sum(max(0, r.start_pos - window + 1) // PT for r in rows) >= 4
        later = ForwardBatch(token_ids=batch.token_ids, positions=batch.positions, kv_page_ids=batch.kv_page_ids,
                             kv_slots=batch.kv_slots, rows=rows, sample_tokens=batch.sample_tokens, lora_groups=[])
        got = attn.forward(q, 0, later, pool)
        pool.data[0, -1] = poisoned
        assert torch.equal(got, want), f"{type(attn).__name__}, seed {seed}: the pages before the window were read"
