"""Page geometry: KV slots and adapter rows map into pages without straddling or
overlapping, the packing is near-minimal, and real model shapes lay out validly."""
from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loraplex.contracts.geometry import (
    DEFAULT_PAGE_TOKENS,
    AdapterLayout,
    PageGeometry,
    adapter_waste,
    kv_waste,
    plan_adapter_layout,
)

MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def llama_shapes(hidden: int, intermediate: int, heads: int, kv_heads: int,
                 head_dim: int) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) per projection, as ModelConfig.module_shapes() gives them."""
    q, kv = heads * head_dim, kv_heads * head_dim
    return {
        "q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (q, hidden),
        "gate_proj": (hidden, intermediate), "up_proj": (hidden, intermediate), "down_proj": (intermediate, hidden),
    }


def check_layout(geometry: PageGeometry, shapes: dict[str, tuple[int, int]], targets, rank: int,
                 layout: AdapterLayout) -> None:
    """Every row placed once, inside one page, with no two rows of a page overlapping."""
    page_elems = geometry.page_elems
    assert layout.rank == rank
    assert set(layout.modules) == set(targets)
    per_page: dict[int, list[tuple[int, int]]] = {}
    total = 0
    for name in targets:
        fan_in, fan_out = shapes[name]
        rows = layout.modules[name]
        assert (rows.in_features, rows.out_features) == (fan_in, fan_out)
        assert len(rows.a) == rank and len(rows.b) == rank
        for width, placements in ((fan_in, rows.a), (fan_out, rows.b)):
            for page, off in placements:
                assert 0 <= page < layout.num_pages
                assert off >= 0 and off + width <= page_elems, f"{name} row straddles page {page}"
                per_page.setdefault(page, []).append((off, off + width))
                total += width
    for page, spans in per_page.items():
        spans.sort()
        for (_, end), (start, _) in zip(spans, spans[1:]):
            assert end <= start, f"rows overlap in page {page}"
    assert set(per_page) == set(range(layout.num_pages)), "a page of the layout holds no row"
    assert layout.used_elems == total
    lower = math.ceil(total / page_elems)
    assert layout.num_pages >= lower
    # First fit leaves at most one page half empty or worse.
    assert (layout.num_pages - 1) * page_elems < 2 * total
    waste = adapter_waste(geometry, layout)
    assert 0.0 <= waste < 1.0
    assert waste == pytest.approx(1 - total / (layout.num_pages * page_elems))


@st.composite
def model_and_adapter(draw):
    kv_dim = draw(st.sampled_from([8, 16, 64, 128, 256, 512, 1024]))
    names = draw(st.lists(st.sampled_from(MODULES), min_size=1, max_size=7, unique=True))
    dims = st.integers(1, 6000)
    shapes = {n: (draw(dims), draw(dims)) for n in names}
    targets = draw(st.lists(st.sampled_from(names), min_size=1, max_size=len(names), unique=True))
    rank = draw(st.integers(1, 48))
    widest = max(max(s) for s in shapes.values())
    need = math.ceil(widest / (2 * kv_dim))
    page_tokens = draw(st.one_of(st.none(), st.integers(need, need + 64)))
    return kv_dim, shapes, targets, rank, page_tokens


@settings(max_examples=150, deadline=None)
@given(model_and_adapter())
def test_random_layouts_are_valid(case) -> None:
    kv_dim, shapes, targets, rank, page_tokens = case
    geometry = PageGeometry.for_model(shapes, kv_dim, page_tokens)
    layout = plan_adapter_layout(geometry, shapes, targets, rank)
    check_layout(geometry, shapes, targets, rank, layout)

    # Flat offsets for a random page table: inside the right page, disjoint across the adapter.
    pages = random.sample(range(4 * layout.num_pages + 8), layout.num_pages)
    flat = layout.row_offsets(pages, geometry.page_elems)
    spans = []
    for name, (a, b) in flat.items():
        fan_in, fan_out = shapes[name]
        assert len(a) == len(b) == rank
        for (p, _), start in zip(layout.modules[name].a, a):
            assert pages[p] * geometry.page_elems <= start and start + fan_in <= (pages[p] + 1) * geometry.page_elems
            spans.append((start, start + fan_in))
        for (p, _), start in zip(layout.modules[name].b, b):
            assert pages[p] * geometry.page_elems <= start and start + fan_out <= (pages[p] + 1) * geometry.page_elems
            spans.append((start, start + fan_out))
    spans.sort()
    assert all(e <= s for (_, e), (s, _) in zip(spans, spans[1:]))
    with pytest.raises(ValueError, match="pages"):
        layout.row_offsets(pages + [max(pages) + 1], geometry.page_elems)


@settings(max_examples=100, deadline=None)
@given(st.sampled_from([1, 8, 96, 128, 1024]), st.dictionaries(st.sampled_from(MODULES),
       st.tuples(st.integers(1, 70000), st.integers(1, 70000)), min_size=1))
def test_for_model_picks_the_smallest_power_of_two_that_fits(kv_dim: int, shapes) -> None:
    widest = max(max(s) for s in shapes.values())
    g = PageGeometry.for_model(shapes, kv_dim)
    assert g.kv_dim == kv_dim and g.max_row_width == widest
    assert g.page_elems == g.page_tokens * 2 * kv_dim >= widest
    assert g.page_tokens >= DEFAULT_PAGE_TOKENS
    assert g.page_tokens & (g.page_tokens - 1) == 0, "page_tokens is a power of two"
    if g.page_tokens > DEFAULT_PAGE_TOKENS:
        assert (g.page_tokens // 2) * 2 * kv_dim < widest, "a smaller power of two would have fit"


def test_for_model_forced_too_small_errors_with_the_minimum() -> None:
    shapes = {"down_proj": (11008, 4096), "q_proj": (4096, 4096)}
    need = math.ceil(11008 / (2 * 128))  # 43
    with pytest.raises(ValueError, match=rf"page_tokens >= {need}\b"):
        PageGeometry.for_model(shapes, kv_dim=128, page_tokens=need - 1)
    ok = PageGeometry.for_model(shapes, kv_dim=128, page_tokens=need)
    assert ok.page_elems >= 11008
    check_layout(ok, shapes, list(shapes), 8, plan_adapter_layout(ok, shapes, list(shapes), 8))


def test_bad_geometry_arguments_raise() -> None:
    with pytest.raises(ValueError):
        PageGeometry(kv_dim=0, page_tokens=16, max_row_width=1)
    with pytest.raises(ValueError):
        PageGeometry(kv_dim=8, page_tokens=0, max_row_width=1)
    with pytest.raises(ValueError):
        PageGeometry.for_model({"q_proj": (64, 64)}, kv_dim=0)  # must not loop forever doubling 0
    with pytest.raises(ValueError):
        PageGeometry.for_model({"q_proj": (64, 64)}, kv_dim=8, page_tokens=0)
    g = PageGeometry(kv_dim=8, page_tokens=4, max_row_width=64)
    with pytest.raises(ValueError, match="rank"):
        plan_adapter_layout(g, {"q_proj": (64, 64)}, ["q_proj"], 0)


def test_layout_refuses_rows_wider_than_a_page() -> None:
    # The geometry was built for other shapes; packing a wider row would straddle pages.
    g = PageGeometry(kv_dim=8, page_tokens=4, max_row_width=64)  # 64-element pages
    with pytest.raises(ValueError, match="wider than a page"):
        plan_adapter_layout(g, {"q_proj": (64, 65)}, ["q_proj"], 2)


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 512), st.integers(1, 64), st.integers(0, 3000))
def test_kv_slots_and_page_counts_are_consistent(kv_dim: int, page_tokens: int, seq_len: int) -> None:
    g = PageGeometry(kv_dim=kv_dim, page_tokens=page_tokens, max_row_width=0)
    pages = g.kv_pages_for(seq_len)
    assert pages == math.ceil(seq_len / page_tokens)
    assert g.kv_pages_for(seq_len + 1) - pages in (0, 1)
    seen: set[tuple[int, int]] = set()
    for pos in range(seq_len):
        page, off = g.kv_slot(pos)
        assert 0 <= page < pages and page < g.kv_pages_for(pos + 1)
        assert off % (2 * kv_dim) == 0 and off + 2 * kv_dim <= g.page_elems  # K then V of one token
        seen.add((page, off))
    assert len(seen) == seq_len, "two positions share a KV slot"
    waste = kv_waste(g, seq_len)
    assert 0.0 <= waste < 1.0
    if seq_len:
        assert waste == pytest.approx(1 - seq_len / (pages * page_tokens))
    else:
        assert waste == 0.0


def test_kv_slot_examples() -> None:
    g = PageGeometry(kv_dim=4, page_tokens=16, max_row_width=0)
    assert g.page_elems == 128
    assert g.kv_slot(0) == (0, 0)
    assert g.kv_slot(1) == (0, 8)
    assert g.kv_slot(15) == (0, 120)
    assert g.kv_slot(16) == (1, 0)
    assert [g.kv_pages_for(n) for n in (0, 1, 16, 17, 32, 33)] == [0, 1, 1, 2, 2, 3]
    assert kv_waste(g, 17) == pytest.approx(15 / 32)


DEMO = llama_shapes(hidden=256, intermediate=704, heads=8, kv_heads=4, head_dim=32)  # kv_dim 128
DEMO_ADAPTERS = (  # (rank, targets) of the demo adapters in gpu_engine/demo/model.py
    (8, ("q_proj", "v_proj")),
    (16, ("q_proj", "k_proj", "v_proj", "o_proj")),
    (32, MODULES),
    (64, ("gate_proj", "up_proj", "down_proj")),
    (16, ("q_proj", "v_proj", "o_proj")),
    (8, ("k_proj", "down_proj")),
)
LLAMA2_7B = llama_shapes(hidden=4096, intermediate=11008, heads=32, kv_heads=32, head_dim=128)  # kv_dim 4096
LLAMA3_8B = llama_shapes(hidden=4096, intermediate=14336, heads=32, kv_heads=8, head_dim=128)  # kv_dim 1024


@pytest.mark.parametrize("rank,targets", DEMO_ADAPTERS)
def test_demo_layouts(rank: int, targets: tuple[str, ...]) -> None:
    g = PageGeometry.for_model(DEMO, kv_dim=128)
    assert (g.page_tokens, g.page_elems) == (16, 4096)
    layout = plan_adapter_layout(g, DEMO, targets, rank)
    check_layout(g, DEMO, targets, rank, layout)


@pytest.mark.parametrize("shapes,kv_dim,page_elems", [(LLAMA2_7B, 4096, 131072), (LLAMA3_8B, 1024, 32768)])
@pytest.mark.parametrize("rank", [8, 16, 64])
@pytest.mark.parametrize("targets", [("q_proj", "v_proj"), MODULES])
def test_llama_layouts(shapes, kv_dim: int, page_elems: int, rank: int, targets) -> None:
    g = PageGeometry.for_model(shapes, kv_dim)
    assert (g.page_tokens, g.page_elems) == (16, page_elems)
    layout = plan_adapter_layout(g, shapes, targets, rank)
    check_layout(g, shapes, targets, rank, layout)
    total = rank * sum(sum(shapes[t]) for t in targets)
    assert layout.num_pages <= math.ceil(total / page_elems) + 1


def test_llama2_7b_rank16_all_modules_packs_into_ten_pages() -> None:
    # Per rank: 8 rows of 4096 (q,k,v,o A and B) + gate/up/down: 3 of 11008 and 3 of 4096;
    # 16 ranks = 1,249,280 elements; ten 131072-element pages by hand-run first fit decreasing.
    g = PageGeometry.for_model(LLAMA2_7B, 4096)
    layout = plan_adapter_layout(g, LLAMA2_7B, MODULES, 16)
    assert layout.used_elems == 1_249_280
    assert layout.num_pages == 10
    assert adapter_waste(g, layout) == pytest.approx(1 - 1_249_280 / 1_310_720)
