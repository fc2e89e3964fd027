"""Unmerged multi-LoRA in plain torch: `y += s·(x A^T) B^T` per adapter group,
with A and B^T rows read from the unified pool through each adapter's row
offsets (the reference the Triton kernels are checked against).

Rows without an adapter cost nothing: only the token segment of each adapter
is multiplied. LoRA on the embedding and the LM head (whose rows are spread over
the layers, contracts/head_modules.py) is applied here too, for both backends:
once a step, by gathering the rows back.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from loraplex.contracts.geometry import AdapterLayout
from loraplex.contracts.head_modules import HEAD_MODULES
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
    # embed_tokens / lm_head -> element indices of A and B^T rows in every layer (each holds its part)
    heads: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)


def _row_index(offsets: list[int], width: int, device: torch.device) -> torch.Tensor:
    base = torch.tensor(offsets, dtype=torch.int64, device=device)
    return base[:, None] + torch.arange(width, dtype=torch.int64, device=device)[None, :]


def resident_lora(pool: UnifiedPool, adapter: HostAdapter, layout: AdapterLayout, pages: list[int]) -> ResidentLora:
    """Where the adapter's rows live in `pages` (gather indices and row offsets); copies nothing."""
    device = pool.data.device
    offsets = layout.row_offsets(pages, pool.geometry.page_elems)
    index: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    row_offsets: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    heads: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for module, (a_off, b_off) in offsets.items():
        rows = layout.modules[module]
        idx = (_row_index(a_off, rows.in_features, device), _row_index(b_off, rows.out_features, device))
        if module in HEAD_MODULES:
            heads[module] = idx
            continue
        index[module] = idx
        row_offsets[module] = (idx[0][:, 0].clone(), idx[1][:, 0].clone())
    return ResidentLora(name=adapter.name, rank=adapter.spec.rank, scaling=adapter.spec.scaling, index=index,
                        row_offsets=row_offsets, heads=heads)


def copy_adapter_layers(pool: UnifiedPool, adapter: HostAdapter, resident: ResidentLora, layers: range, *,
                        heads: bool = True) -> int:
    """Copy A rows and B^T rows of `layers` into the adapter's pages; returns bytes copied.
    heads: also these layers' parts of embed_tokens / lm_head (copy_head_parts copies them alone)."""
    return _copy_rows(pool, adapter, {**resident.index, **resident.heads} if heads else resident.index, layers)


def _copy_rows(pool: UnifiedPool, adapter: HostAdapter, modules: dict[str, tuple[torch.Tensor, torch.Tensor]],
               layers: range) -> int:
    device, dtype = pool.data.device, pool.data.dtype
    copied = 0
    for layer in layers:
        flat = pool.layer_flat(layer)
        for module, (a_idx, b_idx) in modules.items():
            a, b = adapter.a[layer][module], adapter.b[layer][module]
            # a head module's part is [r, pieces * piece]: `pieces` pool rows per rank row
            flat[a_idx] = a.to(device=device, dtype=dtype, non_blocking=True).reshape(a_idx.shape)
            flat[b_idx] = b.t().to(device=device, dtype=dtype, non_blocking=True).reshape(b_idx.shape)
            copied += (a.numel() + b.numel()) * a.element_size()
    return copied


def copy_head_parts(pool: UnifiedPool, adapter: HostAdapter, resident: ResidentLora) -> int:
    """Copy every layer's part of embed_tokens / lm_head (a load's first group carries them: the
    embedding runs before the first layer); returns bytes copied."""
    return _copy_rows(pool, adapter, resident.heads, range(pool.data.shape[0]))


def place_adapter(pool: UnifiedPool, adapter: HostAdapter, layout: AdapterLayout, pages: list[int]) -> ResidentLora:
    """Place the whole adapter at once (every layer)."""
    resident = resident_lora(pool, adapter, layout, pages)
    copy_adapter_layers(pool, adapter, resident, range(pool.data.shape[0]))
    return resident


def head_rows(pool: UnifiedPool, idx: torch.Tensor, rank: int, width: int) -> torch.Tensor:
    """The [rank, width] rows of a head module's side, gathered back from every layer's part."""
    layers = pool.data.shape[0]
    parts = pool.data.view(layers, -1)[:, idx]  # [L, rank * pieces, piece]
    return parts.reshape(layers, rank, -1).transpose(0, 1).reshape(rank, -1)[:, :width]


def embed_lora(pool: UnifiedPool, groups: list[LoraGroup], token_ids: torch.Tensor, out: torch.Tensor) -> None:
    """out[T, hidden] += s·A^T[token] B^T for every token of a group whose adapter adapts
    embed_tokens (peft's lora_embedding_A [r, vocab], _B [hidden, r]). A's columns are gathered
    for the step's tokens only, never the whole [r, vocab]."""
    layers = pool.data.shape[0]
    flat = pool.data.view(layers, -1)
    hidden = out.shape[1]
    for group in groups:
        idx = group.lora.heads.get("embed_tokens")
        if idx is None:
            continue
        a_idx, b_idx = idx
        rank = group.lora.rank
        tokens = token_ids[group.start:group.end]
        pieces, piece = a_idx.shape[0] // rank, a_idx.shape[1]
        per_layer = pieces * piece
        layer, col = tokens // per_layer, tokens % per_layer
        # element (rank row j, token t) sits in layer t // per_layer, at row j*pieces + col // piece
        rows = a_idx.view(rank, pieces, piece)[:, col // piece, col % piece]  # [r, tokens]
        a_t = flat[layer[None, :].expand_as(rows), rows].t()  # [tokens, r]
        bt = head_rows(pool, b_idx, rank, hidden)  # [r, hidden]
        out[group.start:group.end] += (a_t @ bt) * group.lora.scaling


def lm_head_lora(pool: UnifiedPool, segments: list[tuple[int, int, ResidentLora]], x: torch.Tensor,
                 logits: torch.Tensor) -> None:
    """logits[S, vocab] += s·(x A^T) B^T for rows [start, end) of each segment whose adapter adapts
    lm_head; x: the final normed states [S, hidden] the logits came from."""
    hidden, vocab = x.shape[1], logits.shape[1]
    for start, end, lora in segments:
        idx = lora.heads.get("lm_head")
        if idx is None or start == end:
            continue
        a = head_rows(pool, idx[0], lora.rank, hidden)  # [r, hidden]
        bt = head_rows(pool, idx[1], lora.rank, vocab)  # [r, vocab]
        logits[start:end] += ((x[start:end] @ a.t()) @ bt * lora.scaling).float()


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


def pool_rows(pool_layer: torch.Tensor, offsets: torch.Tensor, width: int) -> torch.Tensor:
    """[len(offsets), width]: the rows of `width` elements starting at `offsets` in one layer of the
    pool (1-D).

    Each row lies whole in one page, so rows are gathered whole: index_select over a view of every
    window of the row's width (unfold: no copy), a contiguous copy per row. Gathering element by
    element through an [r, width] index reads 8 bytes of index per 4 of data and ran 4-11x slower
    on CPU (bench/RESULTS.md, "LoRA rows gathered whole"), every step, for every adapter of the
    batch."""
    return pool_layer.unfold(0, width, 1).index_select(0, offsets)


def module_rows(pool_layer: torch.Tensor, lora: ResidentLora, module: str, side: int) -> torch.Tensor:
    """The adapter's A [r, in] (side 0) or B^T [r, out] (side 1) rows of `module` in one pool layer."""
    return pool_rows(pool_layer, lora.row_offsets[module][side], lora.index[module][side].shape[1])


class TorchLoraBackend:
    def apply(self, out: torch.Tensor, x: torch.Tensor, pool_layer: torch.Tensor, module: str,
              groups: list[LoraGroup]) -> None:
        # x: [tokens, in], out: [tokens, out] (base projection output, updated in place)
        for group in groups:
            if module not in group.lora.index:
                continue
            a = module_rows(pool_layer, group.lora, module, 0)  # [r, in]
            bt = module_rows(pool_layer, group.lora, module, 1)  # [r, out]
            segment = slice(group.start, group.end)
            out[segment] += (x[segment] @ a.t()) @ bt * group.lora.scaling
