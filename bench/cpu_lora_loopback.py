"""The engine's and the cache manager's side of the CPU protocol, without an engine.

Owns a host adapter store that tests and benchmarks fill with random
adapters, and an exchange driver that posts x rows, signals ready words and
waits for done words exactly as gpu_engine/cpu_assist.py does on a CPU host.
Lets the worker pool be exercised and measured on its own (tests/test_cpu_lora_pool.py,
bench/cpu_lora_compute.py); never used on the serving path, so it lives with the benches.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from loraplex import _C
from loraplex.cpu_lora.compute import store_dtype
from loraplex.ipc.adapter_store import (
    STORE_ARENA_BASE,
    ArenaAllocator,
    StoreEntry,
    store_entry_layout,
    store_segment_size,
)
from loraplex.ipc.exchange import STAGES, ExchangeLayout
from loraplex.ipc.protocol import CpuJobSlice
from loraplex.ipc.shm import Region, SharedSegment


def _view(segment: SharedSegment, region: Region) -> torch.Tensor:
    flat = torch.frombuffer(segment.buf, dtype=store_dtype(region.dtype), count=region.numel, offset=region.offset)
    return flat.view(region.rows, region.cols)


class HostStore:
    """A store segment (owned here) with arena-relative offsets (base STORE_ARENA_BASE)."""

    def __init__(self, name: str, capacity_bytes: int) -> None:
        self.segment = SharedSegment.create(name, store_segment_size(capacity_bytes))
        self.arena = ArenaAllocator(capacity_bytes)
        self.name = name

    def add_random(self, name: str, rank: int, modules: list[str], layout: ExchangeLayout, *,
                   dtype: str = "float32", seed: int = 0) -> StoreEntry:
        """Place an adapter with random A and Bᵀ (scaled so deltas stay O(1))."""
        shapes = {m: layout.module_shape(m) for m in modules}
        entry = self.arena.place(store_entry_layout(name, rank, shapes, layout.num_layers, dtype))
        if entry is None:
            raise MemoryError(f"store {self.name} has no room for adapter {name!r} ({rank=})")
        gen = torch.Generator().manual_seed(seed)
        for layer in range(layout.num_layers):
            for module in entry.modules:
                a, bt = self.blocks(entry, layer, module.name)
                a.copy_(torch.randn(a.shape, generator=gen) / math.sqrt(module.in_features))
                bt.copy_(torch.randn(bt.shape, generator=gen) / math.sqrt(rank))
        return entry

    def blocks(self, entry: StoreEntry, layer: int, module: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(A [r, in], Bᵀ [r, out]) of `module` in `layer`, as writable views of the segment."""
        a = entry.a_region(layer, module)
        b = entry.b_region(layer, module)
        shift = STORE_ARENA_BASE
        return (_view(self.segment, Region(a.offset + shift, a.rows, a.cols, a.dtype)),
                _view(self.segment, Region(b.offset + shift, b.rows, b.cols, b.dtype)))

    def reference(self, entry: StoreEntry, layer: int, module: str, x: torch.Tensor, scaling: float) -> torch.Tensor:
        """float64 s·(x Aᵀ) Bᵀ for checking worker output."""
        a, bt = self.blocks(entry, layer, module)
        return scaling * (x.double() @ a.double().t()) @ bt.double()

    def close(self) -> None:
        self.segment.close()
        self.segment.unlink()


@dataclass(frozen=True, slots=True)
class Assignment:
    """Which exchange rows (token_start, token_count) run which adapter at what scaling."""

    token_start: int
    token_count: int
    entry: StoreEntry
    scaling: float
    cpu_layers: int | None = None

    def slice(self) -> CpuJobSlice:
        return CpuJobSlice(self.token_start, self.token_count, self.entry, self.scaling, self.cpu_layers)

    def active(self, layer: int) -> bool:
        return self.cpu_layers is None or layer < self.cpu_layers


class ExchangeDriver:
    """The engine's half of the per-site protocol on a CPU host (owns the segment)."""

    def __init__(self, layout: ExchangeLayout) -> None:
        self.layout = layout
        self.segment = layout.create_segment()
        self.words = self.segment.buf
        self.x = [_view(self.segment, layout.x_region(s)) for s in range(len(STAGES))]
        self.out = {m: _view(self.segment, layout.out_region(m)) for m in layout.module_names}

    def post(self, layer: int, stage: int, seq: int, x: torch.Tensor | None = None) -> int:
        """Write x rows [0, len(x)) of the stage (if given), publish ready = seq; returns
        the done count before the post (the base the workers add to)."""
        site = self.layout.site(layer, stage)
        base = _C.atomic_load(self.words, self.layout.done_word(site))
        if x is not None:
            self.x[stage][: x.shape[0]].copy_(x)
        _C.store_and_wake(self.words, self.layout.ready_word(site), seq)
        return base

    def wait_done(self, layer: int, stage: int, target: int, timeout_ms: float) -> bool:
        """Whether done[site] reached `target` within `timeout_ms`."""
        word = self.layout.done_word(self.layout.site(layer, stage))
        return _C.wait_until_at_least(self.words, word, target, timeout_ms)

    def done_count(self, layer: int, stage: int) -> int:
        return _C.atomic_load(self.words, self.layout.done_word(self.layout.site(layer, stage)))

    def abort(self) -> int:
        """Abandon the step in flight (workers drop their jobs); returns the new generation."""
        return _C.add_and_wake(self.words, self.layout.control_word, 1) + 1

    @property
    def generation(self) -> int:
        return _C.atomic_load(self.words, self.layout.control_word)

    def close(self) -> None:
        self.x, self.out = [], {}
        self.segment.close()
        self.segment.unlink()
