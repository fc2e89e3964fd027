"""Page geometry of the unified pool (S-LoRA §5.1): how KV entries and adapter
rows map onto fixed-size pages, and how much of each page is wasted.

Torch-free: the daemon plans with it, the engine lays tensors out with it.
The pool is `[num_layers, num_pages, page_elems]`; one page index reserves the
same slot in every layer, so a page table is valid for the whole model.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

DEFAULT_PAGE_TOKENS = 16


@dataclass(frozen=True, slots=True)
class PageGeometry:
    """A page holds `page_tokens` tokens of K and V for one layer
    (`[page_tokens, 2, kv_dim]`), or whole adapter rows packed one after another.
    """

    kv_dim: int
    page_tokens: int
    max_row_width: int

    def __post_init__(self) -> None:
        if self.kv_dim <= 0 or self.page_tokens <= 0:
            raise ValueError("kv_dim and page_tokens must be positive")
        if self.page_elems < self.max_row_width:
            need = math.ceil(self.max_row_width / (2 * self.kv_dim))
            raise ValueError(
                f"page_tokens={self.page_tokens} gives pages of {self.page_elems} elements, smaller than "
                f"the widest adapter row ({self.max_row_width}); use page_tokens >= {need}"
            )

    @property
    def page_elems(self) -> int:
        return self.page_tokens * 2 * self.kv_dim

    @classmethod
    def for_model(cls, module_shapes: dict[str, tuple[int, int]], kv_dim: int,
                  page_tokens: int | None = None) -> PageGeometry:
        """Smallest power-of-two page_tokens >= the default that fits every row."""
        widest = max(max(shape) for shape in module_shapes.values())
        if kv_dim <= 0:
            raise ValueError("kv_dim must be positive")  # before the doubling loop, which would never end
        if page_tokens is None:
            page_tokens = DEFAULT_PAGE_TOKENS
            while page_tokens * 2 * kv_dim < widest:
                page_tokens *= 2
        return cls(kv_dim=kv_dim, page_tokens=page_tokens, max_row_width=widest)

    def kv_pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_tokens)

    def kv_slot(self, position: int) -> tuple[int, int]:
        """(index into the sequence's page list, element offset of K inside the page); V follows K."""
        page, slot = divmod(position, self.page_tokens)
        return page, slot * 2 * self.kv_dim


@dataclass(frozen=True, slots=True)
class ModuleRows:
    """Where one target module's rows sit: `a[j]`, `b[j]` = (page slot, element offset) of
    rank row j of A (`in_features` wide) and of B transposed (`out_features` wide)."""

    in_features: int
    out_features: int
    a: tuple[tuple[int, int], ...]
    b: tuple[tuple[int, int], ...]


@dataclass(frozen=True, slots=True)
class AdapterLayout:
    """Placement of one adapter's rows in `num_pages` pages (the same in every layer)."""

    rank: int
    num_pages: int
    modules: dict[str, ModuleRows] = field(default_factory=dict)
    used_elems: int = 0

    def row_offsets(self, pages: list[int], page_elems: int) -> dict[str, tuple[list[int], list[int]]]:
        """Flat element offsets (into one layer of the pool) of every A and B row."""
        if len(pages) != self.num_pages:
            raise ValueError(f"layout needs {self.num_pages} pages, got {len(pages)}")
        out: dict[str, tuple[list[int], list[int]]] = {}
        for name, rows in self.modules.items():
            a = [pages[p] * page_elems + off for p, off in rows.a]
            b = [pages[p] * page_elems + off for p, off in rows.b]
            out[name] = (a, b)
        return out


def plan_adapter_layout(geometry: PageGeometry, module_shapes: dict[str, tuple[int, int]],
                        targets: list[str] | tuple[str, ...], rank: int) -> AdapterLayout:
    """Pack rank rows of A then B^T of each target module, never splitting a row across pages.

    Widest rows go first (first-fit decreasing over row widths) so narrow rows fill the gaps.
    """
    if rank <= 0:
        raise ValueError("rank must be positive")
    rows = {name: (rank, module_shapes[name][0], rank, module_shapes[name][1]) for name in targets}
    return pack_adapter_rows(geometry, rows, rank)


def pack_adapter_rows(geometry: PageGeometry, rows: dict[str, tuple[int, int, int, int]],
                      rank: int) -> AdapterLayout:
    """First-fit decreasing packing of each module's (A rows, A width, B^T rows, B^T width), in
    `rows`' order: plan_adapter_layout's rows, or a tensor-parallel rank's shards of them
    (contracts.tensor_parallel), whose counts and widths differ from the rank and the fans."""
    page_elems = geometry.page_elems
    flat: list[tuple[int, str, str, int]] = []  # (width, module, "a"|"b", j)
    for name, (a_rows, a_width, b_rows, b_width) in rows.items():
        flat += [(a_width, name, "a", j) for j in range(a_rows)]
        flat += [(b_width, name, "b", j) for j in range(b_rows)]
    flat.sort(key=lambda r: -r[0])
    if flat and flat[0][0] > page_elems:
        raise ValueError(f"{flat[0][1]} has rows of {flat[0][0]} elements, wider than a page ({page_elems})")
    fill: list[int] = []  # used elements per page
    placed: dict[tuple[str, str, int], tuple[int, int]] = {}
    for width, name, kind, j in flat:
        for p, used in enumerate(fill):
            if used + width <= page_elems:
                break
        else:
            fill.append(0)
            p = len(fill) - 1
        placed[(name, kind, j)] = (p, fill[p])
        fill[p] += width
    modules = {}
    for name, (a_rows, a_width, b_rows, b_width) in rows.items():
        modules[name] = ModuleRows(
            in_features=a_width,
            out_features=b_width,
            a=tuple(placed[(name, "a", j)] for j in range(a_rows)),
            b=tuple(placed[(name, "b", j)] for j in range(b_rows)),
        )
    return AdapterLayout(rank=rank, num_pages=len(fill), modules=modules, used_elems=sum(fill))


def adapter_waste(geometry: PageGeometry, layout: AdapterLayout) -> float:
    """Fraction of the adapter's pages that hold no weight."""
    total = layout.num_pages * geometry.page_elems
    return 0.0 if total == 0 else 1.0 - layout.used_elems / total


def kv_waste(geometry: PageGeometry, seq_len: int) -> float:
    """Fraction of a sequence's KV pages left empty (the partly filled last page)."""
    pages = geometry.kv_pages_for(seq_len)
    return 0.0 if pages == 0 else 1.0 - seq_len / (pages * geometry.page_tokens)
