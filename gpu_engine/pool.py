"""The unified paged pool tensor (S-LoRA §5.1): `[num_layers, num_pages, page_elems]`,
holding KV entries and adapter rows in the same pages.

Owns tensor reads and writes only; which page holds what is decided by the
torch-free allocator in loraplex.daemon.memory.
"""
from __future__ import annotations

import torch

from loraplex.contracts.geometry import PageGeometry


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

    def read_kv(self, layer: int, pages: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        # -> k, v: [length, kv_dim] gathered through the sequence's page table
        entries = self.kv(layer)[pages].flatten(0, 1)[:length]
        return entries[:, 0], entries[:, 1]

    def layer_flat(self, layer: int) -> torch.Tensor:
        return self.data[layer].view(-1)
