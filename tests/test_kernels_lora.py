"""BGMV, MBGMV and SGMV kernels against their torch reference, on fresh random
inputs: heterogeneous ranks, untargeted modules, base-only and dead rows (left
bit-exact), shuffled rows in the pool, odd sizes, fused three-output launches.

Runs on CPU under TRITON_INTERPRET=1 (set before triton is imported), on CUDA
when one is present.
"""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the first import of triton
pytest.importorskip("triton")

from loraplex.kernels import lora_bgmv, lora_mbgmv, lora_sgmv  # noqa: E402
from loraplex.kernels.lora_tables import LoraTables, build_tables  # noqa: E402
from tests.tolerances import assert_within, reduction_bound  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def random_case(seed: int, in_features: int, outs: list[int], ranks: list[int], untargeted: set[tuple[int, int]],
                tokens: int) -> tuple[torch.Tensor, torch.Tensor, LoraTables]:
    """A flat pool layer with every A/B^T row at a shuffled, non-overlapping place; ranks[s] per slot,
    (module, slot) pairs in `untargeted` have no rows. -> x, flat, tables."""
    g = torch.Generator().manual_seed(seed)
    width = max([in_features, *outs])
    rows_needed = 2 * len(outs) * sum(ranks)
    places = (torch.randperm(rows_needed + 7, generator=g) * (width + 3)).tolist()  # gaps between rows
    flat = torch.randn((rows_needed + 7) * (width + 3) + width, generator=g)
    cells: list[list[tuple[list[int], list[int]] | None]] = []
    for m in range(len(outs)):
        row: list[tuple[list[int], list[int]] | None] = []
        for s, r in enumerate(ranks):
            if (m, s) in untargeted:
                row.append(None)
                continue
            row.append(([places.pop() for _ in range(r)], [places.pop() for _ in range(r)]))
        cells.append(row)
    scaling = (torch.rand(len(ranks), generator=g) * 2 + 0.25).tolist()
    x = torch.randn(tokens, in_features, generator=g)
    return x.to(DEVICE), flat.to(DEVICE), build_tables(cells, scaling, DEVICE)


def fresh_outs(seed: int, tokens: int, outs: list[int]) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(tokens, n, generator=g).to(DEVICE) for n in outs]


def check(got: list[torch.Tensor], want: list[torch.Tensor], before: list[torch.Tensor],
          untouched: list[int], magnitude: list[torch.Tensor], terms: int) -> None:
    """Each output within the float32 bound of its `terms`-long reduction (x·A over in, then ·B over the
    rank, the scaling and the add to out) of the reference's, `magnitude` being the same computation on
    absolute values; rows without an adapter bit-exact."""
    for m, (a, b) in enumerate(zip(got, want)):
        assert_within(a, b, reduction_bound(magnitude[m], terms, torch.float32, computations=2), f"module {m}: ")
        for t in untouched:
            assert torch.equal(a[t], before[m][t]), f"module {m} token {t} without adapter changed"


def magnitude(reference, before: list[torch.Tensor], x: torch.Tensor, flat: torch.Tensor, *args) -> list[torch.Tensor]:
    """The reference on absolute values (scalings are positive): each output's sum of |terms|."""
    out = [o.abs() for o in before]
    reference(out, x.abs(), flat.abs(), *args)
    return out


# ---- decode: BGMV (padded) and MBGMV (per-row rank) -------------------------------------------------
GEMV = {"bgmv": (lora_bgmv.bgmv_shrink, lora_bgmv.bgmv_expand, lora_bgmv.bgmv_reference),
        "mbgmv": (lora_mbgmv.mbgmv_shrink, lora_mbgmv.mbgmv_expand, lora_mbgmv.mbgmv_reference)}


@pytest.mark.parametrize("kind", sorted(GEMV))
@pytest.mark.parametrize("split_k", [1, 3])
def test_gemv_fused_heterogeneous_ranks(kind: str, split_k: int) -> None:
    shrink, expand, reference = GEMV[kind]
    outs_n = [37, 20, 20]  # q/k/v-like widths, odd
    x, flat, tables = random_case(11 + split_k, 45, outs_n, ranks=[4, 16, 7], untargeted={(2, 0), (1, 2)},
                                  tokens=7)
    # slots per row: base rows (-1) between adapters; the last rows are dead capacity
    token_slot = torch.tensor([0, -1, 2, 1, 1, 0, -1], dtype=torch.int32, device=DEVICE)
    outs = fresh_outs(5, 7, outs_n)
    before = [o.clone() for o in outs]
    want = [o.clone() for o in outs]
    reference(want, x, flat, token_slot, tables)
    y = shrink(x, flat, token_slot, tables, split_k=split_k, block_k=16)
    expand(outs, y, flat, token_slot, tables, block_n=16)
    check(outs, want, before, [1, 6], magnitude(reference, before, x, flat, token_slot, tables), 45 + 16 + 2)
    # (module 2, slot 0) and (module 1, slot 2) are untargeted: those entries stay exact too
    assert torch.equal(outs[2][0], before[2][0]) and torch.equal(outs[1][2], before[1][2])


@pytest.mark.parametrize("kind", sorted(GEMV))
def test_gemv_single_module_int64_slots_small_rank_chunks(kind: str) -> None:
    shrink, expand, reference = GEMV[kind]
    x, flat, tables = random_case(3, 33, [50], ranks=[12, 3], untargeted=set(), tokens=5)
    token_slot = torch.tensor([1, 0, 0, -1, 1], dtype=torch.int64, device=DEVICE)
    outs = fresh_outs(9, 5, [50])
    before = [o.clone() for o in outs]
    want = [o.clone() for o in outs]
    reference(want, x, flat, token_slot, tables)
    extra = {"block_r": 4} if kind == "mbgmv" else {}
    y = shrink(x, flat, token_slot, tables, block_k=16, **extra)
    expand(outs, y, flat, token_slot, tables, block_n=16, **extra)
    check(outs, want, before, [3], magnitude(reference, before, x, flat, token_slot, tables), 33 + 12 + 2)


# ---- prefill: SGMV over segments ----------------------------------------------------------------------
def test_sgmv_segments_fused() -> None:
    outs_n = [29, 18, 18]
    x, flat, tables = random_case(21, 40, outs_n, ranks=[4, 20, 8], untargeted={(1, 0)}, tokens=41)
    # segments: 3 tokens, 17 tokens (rank 20: two rank chunks of 16), 1 token, a dead one, an empty one;
    # tokens 21..23 and 34..40 belong to no segment
    seg_start = torch.tensor([0, 3, 20, 24, 40], dtype=torch.int32, device=DEVICE)
    seg_len = torch.tensor([3, 17, 1, 10, 0], dtype=torch.int32, device=DEVICE)
    seg_slot = torch.tensor([0, 1, 2, -1, 1], dtype=torch.int32, device=DEVICE)
    outs = fresh_outs(2, 41, outs_n)
    before = [o.clone() for o in outs]
    want = [o.clone() for o in outs]
    lora_sgmv.sgmv_reference(want, x, flat, seg_start, seg_len, seg_slot, tables)
    capacity = 32  # > longest segment: spare tiles exit early
    y = lora_sgmv.sgmv_shrink(x, flat, seg_start, seg_len, seg_slot, tables, capacity, block_m=16, block_r=16,
                              block_k=16)
    lora_sgmv.sgmv_expand(outs, y, flat, seg_start, seg_len, seg_slot, tables, capacity, block_m=16, block_r=16,
                          block_n=16)
    check(outs, want, before, [21, 22, 23, *range(24, 41)],
          magnitude(lora_sgmv.sgmv_reference, before, x, flat, seg_start, seg_len, seg_slot, tables), 40 + 20 + 2)
    assert torch.equal(outs[1][:3], before[1][:3])  # slot 0 does not target module 1


def test_sgmv_single_module_rows_in_one_tile() -> None:
    x, flat, tables = random_case(8, 24, [24], ranks=[6, 6], untargeted=set(), tokens=9)
    seg_start = torch.tensor([1, 4], dtype=torch.int32, device=DEVICE)
    seg_len = torch.tensor([3, 5], dtype=torch.int32, device=DEVICE)
    seg_slot = torch.tensor([1, 0], dtype=torch.int32, device=DEVICE)
    outs = fresh_outs(1, 9, [24])
    before = [o.clone() for o in outs]
    want = [o.clone() for o in outs]
    lora_sgmv.sgmv_reference(want, x, flat, seg_start, seg_len, seg_slot, tables)
    y = lora_sgmv.sgmv_shrink(x, flat, seg_start, seg_len, seg_slot, tables, 5)
    lora_sgmv.sgmv_expand(outs, y, flat, seg_start, seg_len, seg_slot, tables, 5)
    check(outs, want, before, [0],
          magnitude(lora_sgmv.sgmv_reference, before, x, flat, seg_start, seg_len, seg_slot, tables), 24 + 6 + 2)


# ---- launcher checks ------------------------------------------------------------------------------------
def test_launchers_reject_bad_arguments() -> None:
    x, flat, tables = random_case(4, 16, [16, 16], ranks=[4], untargeted=set(), tokens=3)
    slot = torch.zeros(3, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="token_slot"):
        lora_mbgmv.mbgmv_shrink(x, flat, slot.float(), tables)
    with pytest.raises(ValueError, match="token_slot"):
        lora_bgmv.bgmv_shrink(x, flat, slot[:2], tables)
    with pytest.raises(ValueError, match="x must be 2-D"):
        lora_bgmv.bgmv_shrink(x[0], flat, slot, tables)
    with pytest.raises(ValueError, match="contiguous in its last dimension"):
        lora_mbgmv.mbgmv_shrink(x.t().contiguous().t(), flat, slot, tables)
    with pytest.raises(ValueError, match="flat must be 1-D"):
        lora_mbgmv.mbgmv_shrink(x, flat.view(1, -1), slot, tables)
    y = lora_mbgmv.mbgmv_shrink(x, flat, slot, tables)
    with pytest.raises(ValueError, match="y must have size 1"):
        lora_mbgmv.mbgmv_expand(fresh_outs(0, 3, [16]), y, flat, slot, tables)
    with pytest.raises(ValueError, match="share a dtype"):
        lora_bgmv.bgmv_expand([torch.zeros(3, 16, device=DEVICE), torch.zeros(3, 16, dtype=torch.float16,
                                                                                device=DEVICE)],
                              y, flat, slot, tables)
    segs = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="share a dtype"):
        lora_sgmv.sgmv_shrink(x.half(), flat, segs, segs, segs, tables, 1)
    with pytest.raises(ValueError, match="seg_len"):
        lora_sgmv.sgmv_shrink(x, flat, segs, segs[:0], segs, tables, 1)
