"""An engine's read-only view of the cache manager's host adapter store.

Owns the engine's mappings of store segments (one per cache-manager
generation; a restarted cache manager creates a new one) and builds
HostAdapters whose A and B tensors are zero-copy views of the stored blocks.
On CUDA hosts each mapping is registered as pinned memory in this process, so
loads from it are true async DMA. Never writes the store: the cache manager is
its only writer, and it frees an entry only after every engine dropped it.
"""
from __future__ import annotations

import warnings
from pathlib import Path

import torch

from loraplex.errors import AdapterError
from loraplex.gpu_engine.lora.peft_adapter import HostAdapter, read_adapter_spec
from loraplex.gpu_engine.model.config import ModelConfig
from loraplex.ipc.adapter_store import STORE_ARENA_BASE, StoreEntry
from loraplex.ipc.shm import SharedSegment

_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_CUDA_HOST_REGISTER_READ_ONLY = 0x08  # cudaHostRegisterReadOnly: the mapping is PROT_READ


class AttachedStore:
    """One store segment mapped read-only, as flat byte tensor."""

    def __init__(self, name: str, *, pin: bool) -> None:
        self.segment = SharedSegment.attach(name, readonly=True)
        with warnings.catch_warnings():
            # Read-only mapping: torch warns that writes would be undefined; these views are only read.
            warnings.simplefilter("ignore", UserWarning)
            self.bytes = torch.frombuffer(self.segment.buf, dtype=torch.uint8)
        self.pinned = False
        if pin and torch.cuda.is_available():
            rc = torch.cuda.cudart().cudaHostRegister(self.bytes.data_ptr(), self.segment.size,
                                                      _CUDA_HOST_REGISTER_READ_ONLY)
            self.pinned = int(rc) == 0

    def view(self, offset: int, shape: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
        """[rows, cols] of `dtype` at arena offset `offset` (no copy)."""
        start = STORE_ARENA_BASE + offset
        count = shape[0] * shape[1] * dtype.itemsize
        if start + count > self.segment.size:
            raise AdapterError(f"store block at {offset} (+{count} bytes) lies outside {self.segment.name}")
        return self.bytes[start:start + count].view(dtype).view(*shape)

    def close(self) -> None:
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.bytes.data_ptr())
            self.pinned = False
        del self.bytes
        self.segment.close()  # views still alive keep the mapping until they go


class StoreReader:
    """The store segments this engine reads, and which adapter came from which."""

    def __init__(self, *, pin: bool) -> None:
        self.pin = pin
        self.stores: dict[str, AttachedStore] = {}
        self.source: dict[str, str] = {}  # adapter name -> segment its weights are viewed from

    def adapter(self, name: str, path: str, segment: str, entry: StoreEntry, model: ModelConfig, *,
                max_lora_rank: int, roots: tuple[str, ...] = ()) -> HostAdapter:
        """The adapter's spec from its adapter_config.json (read inside `roots`), its weights as views
        of `entry`."""
        spec = read_adapter_spec(path, model, max_lora_rank, roots, name=name)
        if entry.rank != spec.rank or tuple(entry.module_names) != spec.targets or entry.num_layers != model.num_layers:
            raise AdapterError(f"adapter {name}: store entry (rank {entry.rank}, {entry.module_names}) does not "
                               f"match {path} (rank {spec.rank}, {list(spec.targets)})")
        dtype = _TORCH_DTYPES[entry.dtype]
        store = self.stores.get(segment)
        if store is None:
            store = self.stores[segment] = AttachedStore(segment, pin=self.pin)
        a: list[dict[str, torch.Tensor]] = [{} for _ in range(entry.num_layers)]
        b: list[dict[str, torch.Tensor]] = [{} for _ in range(entry.num_layers)]
        for layer in range(entry.num_layers):
            for module in entry.modules:
                a[layer][module.name] = store.view(entry.a_offset(layer, module.name),
                                                   (entry.rank, module.in_features), dtype)  # [r, in]
                bt = store.view(entry.b_offset(layer, module.name), (entry.rank, module.out_features), dtype)
                b[layer][module.name] = bt.t()  # [out, r] over the stored B^T
        return HostAdapter(name=name, path=Path(path), spec=spec, a=a, b=b)

    def bind(self, name: str, segment: str) -> None:
        """`name` is now served from `segment`; mappings no adapter uses any more are closed."""
        self.source[name] = segment
        self._release_unused()

    def forget(self, name: str) -> None:
        self.source.pop(name, None)
        self._release_unused()

    def _release_unused(self) -> None:
        used = set(self.source.values())
        for segment in [s for s in self.stores if s not in used]:
            self.stores.pop(segment).close()

    def close(self) -> None:
        for store in self.stores.values():
            store.close()
        self.stores.clear()
        self.source.clear()
