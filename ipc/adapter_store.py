"""Layout of the host adapter store: one shared-memory arena of adapters.

Owns where an adapter's weights sit (per layer, per target module: A as
[r, in] row-major, then B^T as [r, out] row-major, the row format of the GPU
pool) and the first-fit extent allocator over the arena. Torch-free and
numpy-free bookkeeping: the cache manager writes the bytes, the engine's DMA
and the CPU workers read them through their own views.
"""
from __future__ import annotations

import bisect
import dataclasses
from dataclasses import dataclass

from loraplex.ipc.exchange import ADAPTER_MODULES, MODULE_STAGE, ExchangeModule
from loraplex.ipc.shm import DTYPE_SIZES, HEADER_BYTES, Region

# Canonical module order inside a layer (the order of the GPU pool and the PEFT targets).
# Fused qkv_proj / gate_up_proj (Phi-3, GPT-2) sit where their parts would; a model has one or the other.
# embed_tokens and lm_head last: each layer holds its part of them (contracts/head_modules.py).
MODULE_ORDER: tuple[str, ...] = ADAPTER_MODULES
EXTENT_ALIGN = 256  # every arena extent starts on 256 bytes (vector loads, DMA)
BLOCK_ALIGN = 64  # every A and B^T block inside an entry starts on a cache line
# Where the arena starts in the store segment: one page after the owner header.
STORE_ARENA_BASE = 4096
if STORE_ARENA_BASE < HEADER_BYTES or STORE_ARENA_BASE % EXTENT_ALIGN:
    raise RuntimeError("STORE_ARENA_BASE must clear the segment header and keep extents aligned")


def _align(n: int, to: int) -> int:
    return -(-n // to) * to


def _positive(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def store_segment_size(capacity_bytes: int) -> int:
    """Bytes of a store segment whose arena holds `capacity_bytes` (header page included)."""
    return STORE_ARENA_BASE + capacity_bytes - capacity_bytes % EXTENT_ALIGN


# One target module of a stored adapter (A is [rank, in_features], B^T [rank, out_features]): the
# same record, with the same checks, as a module's slot in the CPU workers' exchange.
StoreModule = ExchangeModule


@dataclass(frozen=True, slots=True)
class StoreEntry:
    """Where one adapter's weights sit in the arena.

    Layer-major: layer l occupies [offset + l*layer_stride, offset + (l+1)*layer_stride),
    so a layer group is one contiguous byte range (one DMA). Inside a layer,
    modules follow MODULE_ORDER, each as A then B^T, every block starting on
    BLOCK_ALIGN bytes. `offset` is -1 until the arena places the entry.
    """

    name: str
    rank: int
    num_layers: int
    dtype: str
    itemsize: int
    modules: list[StoreModule]
    offset: int = -1

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError("store entry name must be a non-empty str")
        _positive("rank", self.rank)
        _positive("num_layers", self.num_layers)
        if DTYPE_SIZES.get(self.dtype) != self.itemsize:
            raise ValueError(f"dtype {self.dtype!r} with itemsize {self.itemsize} is not one of {DTYPE_SIZES}")
        names = [m.name for m in self.modules]
        if not names:
            raise ValueError("a store entry needs at least one target module")
        if names != [m for m in MODULE_ORDER if m in names]:
            raise ValueError(f"modules must be distinct and in canonical order {MODULE_ORDER}, got {names}")
        if isinstance(self.offset, bool) or not isinstance(self.offset, int) or self.offset < -1:
            raise ValueError(f"offset must be an int >= 0 (or -1: not placed), got {self.offset!r}")

    # -- sizes ----------------------------------------------------------------

    def _a_bytes(self, m: StoreModule) -> int:
        return _align(self.rank * m.in_features * self.itemsize, BLOCK_ALIGN)

    def _b_bytes(self, m: StoreModule) -> int:
        return _align(self.rank * m.out_features * self.itemsize, BLOCK_ALIGN)

    @property
    def layer_stride(self) -> int:
        """Bytes of one layer (all its modules' A and B^T blocks)."""
        return sum(self._a_bytes(m) + self._b_bytes(m) for m in self.modules)

    @property
    def nbytes(self) -> int:
        return self.num_layers * self.layer_stride

    @property
    def module_names(self) -> list[str]:
        return [m.name for m in self.modules]

    @property
    def staged_modules(self) -> list[StoreModule]:
        """The modules a CPU worker computes (those with an exchange stage): not embed_tokens or
        lm_head, whose LoRA the engine applies itself."""
        return [m for m in self.modules if m.name in MODULE_STAGE]

    def module(self, name: str) -> StoreModule:
        for m in self.modules:
            if m.name == name:
                return m
        raise KeyError(f"adapter {self.name!r} does not target {name!r} (targets {self.module_names})")

    # -- offsets (need a placed entry) ----------------------------------------

    @property
    def placed(self) -> bool:
        return self.offset >= 0

    def at(self, offset: int) -> StoreEntry:
        """This entry placed at arena offset `offset`."""
        return dataclasses.replace(self, offset=offset)

    def _layer_start(self, layer: int) -> int:
        if not self.placed:
            raise ValueError(f"store entry {self.name!r} has no offset yet (place it in the arena first)")
        if not 0 <= layer < self.num_layers:
            raise IndexError(f"layer {layer} outside [0, {self.num_layers})")
        return self.offset + layer * self.layer_stride

    def a_offset(self, layer: int, module: str) -> int:
        """Byte offset (relative to the arena start) of A [rank, in] of `module` in `layer`."""
        at = self._layer_start(layer)
        for m in self.modules:
            if m.name == module:
                return at
            at += self._a_bytes(m) + self._b_bytes(m)
        raise KeyError(f"adapter {self.name!r} does not target {module!r} (targets {self.module_names})")

    def b_offset(self, layer: int, module: str) -> int:
        """Byte offset of B^T [rank, out] of `module` in `layer` (right after its A block)."""
        return self.a_offset(layer, module) + self._a_bytes(self.module(module))

    def a_region(self, layer: int, module: str) -> Region:
        return Region(self.a_offset(layer, module), self.rank, self.module(module).in_features, self.dtype)

    def b_region(self, layer: int, module: str) -> Region:
        return Region(self.b_offset(layer, module), self.rank, self.module(module).out_features, self.dtype)

    def layer_span(self, first: int, stop: int) -> tuple[int, int]:
        """(offset, nbytes) of layers [first, stop): one contiguous range, e.g. a load group."""
        if not 0 <= first < stop <= self.num_layers:
            raise IndexError(f"layers [{first}, {stop}) outside [0, {self.num_layers})")
        return self._layer_start(first), (stop - first) * self.layer_stride


def store_entry_layout(name: str, rank: int, modules: dict[str, tuple[int, int]], num_layers: int,
                       dtype: str) -> StoreEntry:
    """The (unplaced) layout of an adapter: `modules` maps target module -> (in, out)."""
    unknown = sorted(set(modules) - set(MODULE_ORDER))
    if unknown:
        raise ValueError(f"unknown target module(s) {unknown}; expected names from {MODULE_ORDER}")
    if dtype not in DTYPE_SIZES:
        raise ValueError(f"unsupported store dtype {dtype!r}; expected one of {sorted(DTYPE_SIZES)}")
    ordered = [StoreModule(m, *modules[m]) for m in MODULE_ORDER if m in modules]
    return StoreEntry(name=name, rank=rank, num_layers=num_layers, dtype=dtype, itemsize=DTYPE_SIZES[dtype],
                      modules=ordered)


class ArenaAllocator:
    """First-fit allocation of EXTENT_ALIGN-aligned extents in [0, capacity), with
    free-time coalescing of neighbours. Offsets returned are `base` + the
    position in the arena (base 0: relative to the arena start;
    STORE_ARENA_BASE: offsets into the store segment).

    Invariants: allocated and free extents never overlap and tile the arena;
    no two free extents touch (they would have been merged);
    used_bytes + free_bytes == capacity.
    """

    def __init__(self, capacity_bytes: int, base: int = 0) -> None:
        if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int) or capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be an int >= 0, got {capacity_bytes!r}")
        if isinstance(base, bool) or not isinstance(base, int) or base < 0 or base % EXTENT_ALIGN:
            raise ValueError(f"base must be a non-negative multiple of {EXTENT_ALIGN}, got {base!r}")
        self._capacity = capacity_bytes - capacity_bytes % EXTENT_ALIGN
        self._base = base
        # Free extents, sorted by start (positions relative to the arena start).
        self._free_starts: list[int] = [0] if self._capacity else []
        self._free_sizes: list[int] = [self._capacity] if self._capacity else []
        self._allocated: dict[int, int] = {}
        self._used = 0

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def base(self) -> int:
        return self._base

    @property
    def used_bytes(self) -> int:
        return self._used

    @property
    def free_bytes(self) -> int:
        return self._capacity - self._used

    @property
    def largest_free(self) -> int:
        """The largest request that would succeed now."""
        return max(self._free_sizes, default=0)

    @property
    def num_allocations(self) -> int:
        return len(self._allocated)

    @staticmethod
    def extent_size(nbytes: int) -> int:
        """Bytes an allocation of `nbytes` takes (rounded up to EXTENT_ALIGN)."""
        return _align(nbytes, EXTENT_ALIGN)

    def allocate(self, nbytes: int) -> int | None:
        """Offset of a new extent of at least `nbytes`, or None if no free extent fits."""
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes <= 0:
            raise ValueError(f"nbytes must be a positive int, got {nbytes!r}")
        size = self.extent_size(nbytes)
        for i, free in enumerate(self._free_sizes):
            if free >= size:
                start = self._free_starts[i]
                if free == size:
                    del self._free_starts[i], self._free_sizes[i]
                else:
                    self._free_starts[i] += size
                    self._free_sizes[i] -= size
                self._allocated[start] = size
                self._used += size
                return self._base + start
        return None

    def free(self, offset: int) -> int:
        """Release the extent at `offset`; returns its size. ValueError for an
        offset that is not the start of a live extent (double free included)."""
        start = offset - self._base
        size = self._allocated.pop(start, None)
        if size is None:
            raise ValueError(f"offset {offset} is not an allocated extent")
        self._used -= size
        i = bisect.bisect_left(self._free_starts, start)
        merge_prev = i > 0 and self._free_starts[i - 1] + self._free_sizes[i - 1] == start
        merge_next = i < len(self._free_starts) and start + size == self._free_starts[i]
        if merge_prev and merge_next:
            self._free_sizes[i - 1] += size + self._free_sizes[i]
            del self._free_starts[i], self._free_sizes[i]
        elif merge_prev:
            self._free_sizes[i - 1] += size
        elif merge_next:
            self._free_starts[i] = start
            self._free_sizes[i] += size
        else:
            self._free_starts.insert(i, start)
            self._free_sizes.insert(i, size)
        return size

    def size_of(self, offset: int) -> int:
        """Size of the live extent at `offset`; KeyError if none."""
        try:
            return self._allocated[offset - self._base]
        except KeyError:
            raise KeyError(f"offset {offset} is not an allocated extent") from None

    def free_extents(self) -> list[tuple[int, int]]:
        """(offset, size) of every free extent, by offset."""
        return [(self._base + s, n) for s, n in zip(self._free_starts, self._free_sizes)]

    def allocations(self) -> list[tuple[int, int]]:
        """(offset, size) of every live extent, by offset."""
        return sorted((self._base + s, n) for s, n in self._allocated.items())

    def place(self, entry: StoreEntry) -> StoreEntry | None:
        """Allocate room for `entry` and return it placed there, or None if it does not fit."""
        offset = self.allocate(entry.nbytes)
        return None if offset is None else entry.at(offset)
