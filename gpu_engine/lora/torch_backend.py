"""Unmerged multi-LoRA in plain torch: `y += s·(x A^T) B^T` per adapter group,
with A and B^T rows read from the unified pool through each adapter's row
offsets (the reference the Triton kernels are checked against).

Rows without an adapter cost nothing: only the token segment of each adapter
is multiplied.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from loraplex.contracts.geometry import AdapterLayout
from loraplex.gpu_engine.lora.peft_adapter import HostAdapter
from loraplex.gpu_engine.pool import UnifiedPool


@dataclass(slots=True)
class ResidentLora:
    """An adapter placed in pool pages: flat gather indices of its rows in every layer."""

    name: str
    rank: int
    scaling: float
    index: dict[str, tuple[torch.Tensor, torch.Tensor]]  # module -> ([r, in], [r, out]) element indices
    row_offsets: dict[str, tuple[torch.Tensor, torch.Tensor]]  # module -> ([r], [r]) first element of each row


def _row_index(offsets: list[int], width: int, device: torch.device) -> torch.Tensor:
    base = torch.tensor(offsets, dtype=torch.int64, device=device)
    return base[:, None] + torch.arange(width, dtype=torch.int64, device=device)[None, :]


def resident_lora(pool: UnifiedPool, adapter: HostAdapter, layout: AdapterLayout, pages: list[int]) -> ResidentLora:
    """Where the adapter's rows live in `pages` (gather indices and row offsets); copies nothing."""
    device = pool.data.device
    offsets = layout.row_offsets(pages, pool.geometry.page_elems)
    index: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    row_offsets: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for module, (a_off, b_off) in offsets.items():
        rows = layout.modules[module]
        index[module] = (_row_index(a_off, rows.in_features, device), _row_index(b_off, rows.out_features, device))
        row_offsets[module] = (index[module][0][:, 0].clone(), index[module][1][:, 0].clone())
    return ResidentLora(name=adapter.name, rank=adapter.spec.rank, scaling=adapter.spec.scaling, index=index,
                        row_offsets=row_offsets)


def copy_adapter_layers(pool: UnifiedPool, adapter: HostAdapter, resident: ResidentLora, layers: range) -> int:
    """Copy A rows and B^T rows of `layers` into the adapter's pages; returns bytes copied."""
    device, dtype = pool.data.device, pool.data.dtype
    copied = 0
    for layer in layers:
        flat = pool.layer_flat(layer)
        for module, (a_idx, b_idx) in resident.index.items():
            a, b = adapter.a[layer][module], adapter.b[layer][module]
            flat[a_idx] = a.to(device=device, dtype=dtype, non_blocking=True)
            flat[b_idx] = b.t().to(device=device, dtype=dtype, non_blocking=True)
            copied += (a.numel() + b.numel()) * a.element_size()
    return copied


def place_adapter(pool: UnifiedPool, adapter: HostAdapter, layout: AdapterLayout, pages: list[int]) -> ResidentLora:
    """Place the whole adapter at once (every layer)."""
    resident = resident_lora(pool, adapter, layout, pages)
    copy_adapter_layers(pool, adapter, resident, range(pool.data.shape[0]))
    return resident


@dataclass(slots=True)
class LoraGroup:
    """A segment of the step's flattened tokens that all use one adapter
    (the executor orders rows by adapter, so each adapter is one segment)."""

    lora: ResidentLora
    start: int
    end: int
    cpu_layers: int = 0  # layers [0, cpu_layers) of this segment run on the CPU workers instead
    load: object | None = None  # GroupLoad while the adapter's layer groups are still arriving

    def on_gpu(self, layer: int) -> bool:
        return layer >= self.cpu_layers


class TorchLoraBackend:
    def apply(self, out: torch.Tensor, x: torch.Tensor, pool_layer: torch.Tensor, module: str,
              groups: list[LoraGroup]) -> None:
        # x: [tokens, in], out: [tokens, out] (base projection output, updated in place)
        for group in groups:
            idx = group.lora.index.get(module)
            if idx is None:
                continue
            a = pool_layer[idx[0]]  # [r, in]
            bt = pool_layer[idx[1]]  # [r, out]
            segment = slice(group.start, group.end)
            out[segment] += (x[segment] @ a.t()) @ bt * group.lora.scaling
