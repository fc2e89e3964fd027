"""The host adapter store in shared memory: adapters in the layout the CPU
workers and the pool loader read directly (ipc/adapter_store.py), with no
per-request copies.

The engine writes each adapter once when it is added; the HostAdapter's A and
B tensors are then rebound to zero-copy views of the arena, so the loader's
host->pool copies and the engine's fallback compute read the same bytes the
workers read. On CUDA hosts the segment is registered as pinned memory so
loads are true async DMA.
"""
from __future__ import annotations

import torch

from loraplex.gpu_engine.lora.peft_adapter import HostAdapter
from loraplex.ipc.adapter_store import (
    STORE_ARENA_BASE,
    ArenaAllocator,
    StoreEntry,
    store_entry_layout,
    store_segment_size,
)
from loraplex.ipc.shm import SharedSegment

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


class StoreFull(RuntimeError):
    """The host store cannot hold another adapter of this size."""


class HostStore:
    def __init__(self, segment_name: str, capacity_bytes: int, dtype: torch.dtype, *, pin: bool = False) -> None:
        self.segment = SharedSegment.create(segment_name, store_segment_size(capacity_bytes))
        self.arena = ArenaAllocator(self.segment.size - STORE_ARENA_BASE)
        self.dtype = dtype
        self.entries: dict[str, StoreEntry] = {}
        self._bytes = torch.frombuffer(self.segment.buf, dtype=torch.uint8)
        self.pinned = False
        if pin and torch.cuda.is_available():
            cudart = torch.cuda.cudart()
            rc = cudart.cudaHostRegister(self._bytes.data_ptr(), self.segment.size, 0)
            self.pinned = int(rc) == 0

    @property
    def name(self) -> str:
        return self.segment.name

    def put(self, adapter: HostAdapter, module_shapes: dict[str, tuple[int, int]], num_layers: int) -> StoreEntry:
        """Copy the adapter into the arena and rebind its tensors to views of it."""
        self.remove(adapter.name)
        layout = store_entry_layout(adapter.name, adapter.spec.rank,
                                    {m: module_shapes[m] for m in adapter.spec.targets}, num_layers,
                                    _DTYPE_NAMES[self.dtype])
        offset = self.arena.allocate(layout.nbytes)
        if offset is None:
            raise StoreFull(f"host store full: adapter {adapter.name!r} needs {layout.nbytes} bytes, "
                            f"{self.arena.free_bytes} free")
        entry = layout.at(offset)
        for layer in range(num_layers):
            for module in adapter.spec.targets:
                a = self._view(entry.a_offset(layer, module), adapter.a[layer][module].shape)
                bt = self._view(entry.b_offset(layer, module), (adapter.spec.rank, module_shapes[module][1]))
                a.copy_(adapter.a[layer][module])
                bt.copy_(adapter.b[layer][module].t())
                adapter.a[layer][module] = a
                adapter.b[layer][module] = bt.t()  # [out, r] view over the stored B^T
        self.entries[adapter.name] = entry
        return entry

    def _view(self, offset: int, shape) -> torch.Tensor:
        start = STORE_ARENA_BASE + offset
        count = int(torch.Size(shape).numel())
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return self._bytes[start:start + count * itemsize].view(self.dtype).view(*shape)

    def remove(self, name: str) -> None:
        entry = self.entries.pop(name, None)
        if entry is not None:
            self.arena.free(entry.offset)

    def close(self) -> None:
        self.entries.clear()
        del self._bytes
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.segment.buf)
        self.segment.close()
        if self.segment.owner:
            self.segment.unlink()
