"""The unified paged pool tensor (S-LoRA §5.1): `[num_layers, num_pages, page_elems]`,
holding KV entries and adapter rows in the same pages.

Owns tensor reads and writes only; which page holds what is decided by the
torch-free allocator in loraplex.daemon.memory (and, on sliding-window models,
which pages may leave before their sequence ends: `kv_window`).
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from loraplex.contracts.geometry import PageGeometry


def kv_window(layer_windows: Sequence[int | None]) -> int | None:
    """The sliding window every attention layer shares, None when some layer sees its whole
    context. A page holds every layer's K/V for its positions, so a page can leave the pool before
    its sequence ends only when all layers slide (Mistral): the engine reports this to the daemon."""
    windows = set(layer_windows)
    return windows.pop() if len(windows) == 1 and None not in windows else None


class UnifiedPool:
    def __init__(self, num_layers: int, num_pages: int, geometry: PageGeometry, *,
                 device: torch.device, dtype: torch.dtype) -> None:
        self.geometry = geometry
        self.num_pages = num_pages
        # Zeroed so that a bug reading an unwritten slot shows up as a wrong answer, not as NaNs.
        self.data = torch.zeros(num_layers, num_pages, geometry.page_elems, device=device, dtype=dtype)

    @staticmethod
    def pages_for_bytes(num_layers: int, geometry: PageGeometry, dtype: torch.dtype, nbytes: int) -> int:
        per_page = num_layers * geometry.page_elems * torch.empty((), dtype=dtype).element_size()
        return max(1, nbytes // per_page)

    def kv(self, layer: int) -> torch.Tensor:
        # [pages, page_tokens, 2, kv_dim]
        g = self.geometry
        return self.data[layer].view(self.num_pages, g.page_tokens, 2, g.kv_dim)

    def write_kv(self, layer: int, page_ids: torch.Tensor, slots: torch.Tensor,
                 k: torch.Tensor, v: torch.Tensor) -> None:
        # page_ids, slots: [tokens]; k, v: [tokens, kv_dim]
        kv = self.kv(layer)
        kv[page_ids, slots, 0] = k
        kv[page_ids, slots, 1] = v

    def read_kv(self, layer: int, pages: torch.Tensor, length: int,
                first_key: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """-> k, v: [length, kv_dim] gathered through the sequence's page table. Pages wholly
        before `first_key` (the oldest key a sliding window lets the row's queries see) are not
        read and come back as zeros: a sliding-window model gives them back to the pool, and
        their table entries are placeholders (daemon/scheduler/kv_pages.py)."""
        skip = first_key // self.geometry.page_tokens * self.geometry.page_tokens
        # index_select, not kv[pages]: it copies whole pages (4-5x faster on the CPU than advanced indexing)
        entries = torch.index_select(self.kv(layer), 0, pages[skip // self.geometry.page_tokens:])
        entries = entries.flatten(0, 1)[:max(length - skip, 0)]
        if skip:
            entries = torch.cat([entries.new_zeros((min(skip, length),) + entries.shape[1:]), entries])
        return entries[:, 0], entries[:, 1]

    def layer_flat(self, layer: int) -> torch.Tensor:
        return self.data[layer].view(-1)
