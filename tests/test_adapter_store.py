"""ipc.adapter_store: store entries (canonical order, blocks inside the entry,
disjoint and aligned, layer groups contiguous), their travel as message records,
and the first-fit arena allocator (property test: no overlap, coalescing,
conservation)."""
from __future__ import annotations

import dataclasses
import struct

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loraplex.ipc.adapter_store import (
    BLOCK_ALIGN,
    EXTENT_ALIGN,
    MODULE_ORDER,
    STORE_ARENA_BASE,
    ArenaAllocator,
    StoreEntry,
    store_entry_layout,
    store_segment_size,
)
from loraplex.ipc.errors import ProtocolError
from loraplex.ipc.messages.fields import compile_checker
from loraplex.ipc.shm import HEADER_BYTES

LLAMA_7B = {"q_proj": (4096, 4096), "k_proj": (4096, 4096), "v_proj": (4096, 4096), "o_proj": (4096, 4096),
            "gate_proj": (4096, 11008), "up_proj": (4096, 11008), "down_proj": (11008, 4096)}

module_sets = st.sets(st.sampled_from(MODULE_ORDER), min_size=1)
shapes = st.tuples(st.integers(1, 300), st.integers(1, 300))


def entry_blocks(entry: StoreEntry) -> list[tuple[int, int]]:
    """(offset, nbytes) of every A and B^T block, all layers."""
    out = []
    for layer in range(entry.num_layers):
        for m in entry.modules:
            out.append((entry.a_offset(layer, m.name), entry.rank * m.in_features * entry.itemsize))
            out.append((entry.b_offset(layer, m.name), entry.rank * m.out_features * entry.itemsize))
    return out


@settings(max_examples=150, deadline=None)
@given(names=module_sets, data=st.data(), rank=st.integers(1, 64), layers=st.integers(1, 6),
       dtype=st.sampled_from(["float32", "bfloat16", "float16"]), slot=st.integers(0, 1000))
def test_store_entry_blocks_inside_disjoint_and_aligned(names, data, rank, layers, dtype, slot) -> None:
    modules = {name: data.draw(shapes) for name in sorted(names, reverse=True)}  # any dict order
    entry = store_entry_layout("a", rank, modules, layers, dtype).at(slot * EXTENT_ALIGN)
    assert entry.module_names == [m for m in MODULE_ORDER if m in names]
    assert entry.itemsize == {"float32": 4, "bfloat16": 2, "float16": 2}[dtype]
    assert entry.nbytes == layers * entry.layer_stride
    blocks = sorted(entry_blocks(entry))
    for offset, nbytes in blocks:
        assert entry.offset <= offset and offset + nbytes <= entry.offset + entry.nbytes
        assert offset % BLOCK_ALIGN == 0
    for (a, n), (b, _) in zip(blocks, blocks[1:]):
        assert a + n <= b
    # B^T follows its A; each layer is one contiguous range of the entry.
    for m in entry.modules:
        a = entry.a_region(layers - 1, m.name)
        b = entry.b_region(layers - 1, m.name)
        assert (a.rows, a.cols, b.rows, b.cols) == (rank, m.in_features, rank, m.out_features)
        assert a.dtype == b.dtype == dtype and b.offset >= a.end
    start, nbytes = entry.layer_span(0, layers)
    assert (start, nbytes) == (entry.offset, entry.nbytes)
    if layers > 1:
        assert entry.layer_span(1, layers) == (entry.offset + entry.layer_stride, (layers - 1) * entry.layer_stride)


def test_store_entry_sizes_for_a_real_model() -> None:
    entry = store_entry_layout("big", 16, LLAMA_7B, 32, "float16")
    per_layer = sum(16 * (i + o) * 2 for i, o in LLAMA_7B.values())
    assert entry.layer_stride == per_layer  # real dims are cache-line multiples already: no padding
    assert entry.nbytes == 32 * per_layer


def test_store_entry_errors() -> None:
    entry = store_entry_layout("a", 4, {"v_proj": (8, 4), "q_proj": (8, 8)}, 2, "float32")
    with pytest.raises(ValueError, match="no offset"):
        entry.a_offset(0, "q_proj")
    placed = entry.at(256)
    with pytest.raises(KeyError):
        placed.a_offset(0, "k_proj")
    with pytest.raises(IndexError):
        placed.b_offset(2, "q_proj")
    with pytest.raises(IndexError):
        placed.layer_span(1, 1)
    with pytest.raises(ValueError, match="unknown target"):
        store_entry_layout("a", 4, {"score": (8, 8)}, 2, "float32")
    with pytest.raises(ValueError, match="dtype"):
        store_entry_layout("a", 4, {"q_proj": (8, 8)}, 2, "int8")
    for bad in ({"rank": 0}, {"num_layers": 0}, {"modules": []}, {"itemsize": 2}, {"offset": -2}, {"name": ""}):
        with pytest.raises(ValueError):
            dataclasses.replace(entry, **bad)
    with pytest.raises(ValueError, match="canonical order"):
        dataclasses.replace(entry, modules=list(reversed(entry.modules)))


def test_store_entry_travels_as_a_message_record() -> None:
    entry = store_entry_layout("qv-r8", 8, {"q_proj": (64, 64), "v_proj": (64, 16)}, 4, "bfloat16").at(4096)
    check = compile_checker(StoreEntry)
    wire = msgpack.unpackb(msgpack.packb(dataclasses.asdict(entry)))
    decoded = check(wire, "entry")
    assert decoded == entry and decoded.b_offset(3, "v_proj") == entry.b_offset(3, "v_proj")
    with pytest.raises(ProtocolError):
        check({**wire, "rank": -1}, "entry")
    with pytest.raises(ProtocolError):
        check({**wire, "modules": [{"name": "q_proj", "in_features": 64}]}, "entry")


def test_rows_written_at_the_offsets_read_back_as_a_and_b_transposed() -> None:
    """The byte format: A row-major [r, in], then B^T row-major [r, out], per layer and module."""
    rank, layers = 3, 2
    modules = {"q_proj": (5, 7), "down_proj": (9, 5)}
    entry = store_entry_layout("a", rank, modules, layers, "float32").at(STORE_ARENA_BASE)
    seg = bytearray(STORE_ARENA_BASE + entry.nbytes)

    def a_val(layer, module, j, i):
        return float(layer * 1000 + MODULE_ORDER.index(module) * 100 + j * 10 + i)

    def b_val(layer, module, o, j):  # B is [out, r]; the store holds B^T [r, out]
        return -float(layer * 1000 + MODULE_ORDER.index(module) * 100 + o * 10 + j)

    for layer in range(layers):
        for module, (fan_in, fan_out) in modules.items():
            a = [a_val(layer, module, j, i) for j in range(rank) for i in range(fan_in)]
            bt = [b_val(layer, module, o, j) for j in range(rank) for o in range(fan_out)]
            struct.pack_into(f"<{len(a)}f", seg, entry.a_offset(layer, module), *a)
            struct.pack_into(f"<{len(bt)}f", seg, entry.b_offset(layer, module), *bt)
    for layer in range(layers):
        for module, (fan_in, fan_out) in modules.items():
            region = entry.b_region(layer, module)
            row1 = struct.unpack_from(f"<{fan_out}f", seg, region.row_offset(1))
            assert list(row1) == [b_val(layer, module, o, 1) for o in range(fan_out)]
            a_row2 = struct.unpack_from(f"<{fan_in}f", seg, entry.a_region(layer, module).row_offset(2))
            assert list(a_row2) == [a_val(layer, module, 2, i) for i in range(fan_in)]


# -- arena allocator ---------------------------------------------------------------------


def test_arena_first_fit_and_coalescing() -> None:
    arena = ArenaAllocator(10 * 256 + 100)  # rounds down to whole extents
    assert arena.capacity == 2560 and arena.free_bytes == 2560
    a = arena.allocate(1)
    b = arena.allocate(300)
    c = arena.allocate(256)
    assert (a, b, c) == (0, 256, 768)
    assert arena.size_of(b) == 512 and arena.used_bytes == 1024
    arena.free(a)
    assert arena.allocate(257) == 1024  # first fit skips the 256-byte hole
    assert arena.allocate(200) == 0  # and fills it with what fits
    arena.free(0)
    arena.free(c)
    arena.free(b)  # merges with both neighbours
    assert arena.free_extents() == [(0, 1024), (1536, 1024)]
    assert arena.allocate(2048) is None
    arena.free(1024)
    assert arena.free_extents() == [(0, 2560)] and arena.used_bytes == 0
    with pytest.raises(ValueError):
        arena.free(1024)  # double free
    with pytest.raises(ValueError):
        arena.free(13)
    for bad in (0, -1, 1.5):
        with pytest.raises(ValueError):
            arena.allocate(bad)


def test_arena_with_a_base_returns_segment_offsets() -> None:
    arena = ArenaAllocator(1 << 20, base=STORE_ARENA_BASE)
    entry = arena.place(store_entry_layout("a", 8, {"q_proj": (64, 64)}, 2, "float32"))
    assert entry is not None and entry.offset == STORE_ARENA_BASE
    assert entry.a_offset(0, "q_proj") >= STORE_ARENA_BASE > HEADER_BYTES
    assert arena.place(store_entry_layout("b", 8, {"q_proj": (64, 1 << 20)}, 2, "float32")) is None
    assert store_segment_size(1 << 20) == STORE_ARENA_BASE + (1 << 20)
    with pytest.raises(ValueError):
        ArenaAllocator(1024, base=100)
    empty = ArenaAllocator(100)
    assert empty.capacity == 0 and empty.allocate(1) is None and empty.largest_free == 0


def check_arena_invariants(arena: ArenaAllocator, live: dict[int, int]) -> None:
    allocations = arena.allocations()
    assert dict(allocations) == {off: ArenaAllocator.extent_size(n) for off, n in live.items()}
    free = arena.free_extents()
    extents = sorted([(o, s, "used") for o, s in allocations] + [(o, s, "free") for o, s in free])
    at = arena.base
    for offset, size, _ in extents:  # used and free extents tile the arena exactly: no overlap, no gap
        assert offset == at and size > 0 and offset % EXTENT_ALIGN == 0 and size % EXTENT_ALIGN == 0
        at += size
    assert at == arena.base + arena.capacity
    for (o1, s1), (o2, _) in zip(free, free[1:]):
        assert o1 + s1 < o2, "two free extents touch: not coalesced"
    assert arena.used_bytes == sum(s for _, s in allocations)
    assert arena.used_bytes + arena.free_bytes == arena.capacity
    assert arena.largest_free == max((s for _, s in free), default=0)
    for offset, nbytes in live.items():
        assert arena.size_of(offset) >= nbytes


ops = st.lists(st.tuples(st.booleans(), st.integers(1, 3000), st.integers(0, 10_000)), max_size=120)


@settings(max_examples=200, deadline=None)
@given(capacity=st.integers(0, 40_000), base_pages=st.integers(0, 4), ops=ops)
def test_arena_property(capacity: int, base_pages: int, ops) -> None:
    arena = ArenaAllocator(capacity, base=base_pages * EXTENT_ALIGN)
    live: dict[int, int] = {}
    for allocate, nbytes, pick in ops:
        if allocate or not live:
            size = ArenaAllocator.extent_size(nbytes)
            first_fit = next((o for o, s in arena.free_extents() if s >= size), None)
            offset = arena.allocate(nbytes)
            assert offset == first_fit  # None exactly when no free extent is large enough
            if offset is not None:
                assert offset not in live
                live[offset] = nbytes
        else:
            offset = sorted(live)[pick % len(live)]
            assert arena.free(offset) == ArenaAllocator.extent_size(live.pop(offset))
        check_arena_invariants(arena, live)
    for offset in list(live):
        arena.free(offset)
        del live[offset]
    check_arena_invariants(arena, live)
    assert arena.free_extents() == ([(arena.base, arena.capacity)] if arena.capacity else [])
