"""The cache manager process (`loraplex-cache-manager`): owns the host tier.

It reads adapters from disk, validates them against the base model's
config.json (no weights are loaded, no GPU is touched), converts them to the
kernel layout and places them in the shared-memory host store it creates and
unlinks; engines and CPU workers map the store read-only. It makes no policy
decision: the daemon says what to load and what to evict. Like the engine, it
dies with its parent (PDEATHSIG), names its role, heartbeats over a pipe, and
answers every order with a reply (a full store is `cache_store_full`).
"""
from __future__ import annotations

import logging
import os
import traceback

from loraplex.contracts.engine_spec import EngineSpec
from loraplex.contracts.tensor_parallel import TensorParallelPlan
from loraplex.errors import LoraplexRequestError
from loraplex.gpu_engine.child_process import run_child
from loraplex.gpu_engine.host_store import HostStore, StoreFull
from loraplex.gpu_engine.lora.peft_adapter import load_peft_adapter
from loraplex.gpu_engine.model.config import ModelConfig
from loraplex.gpu_engine.runtime import DTYPES, resolve_spec
from loraplex.ipc.adapter_files import allow_also, resolve_roots
from loraplex.ipc.adapter_store import ArenaAllocator, store_entry_layout
from loraplex.ipc.errors import ErrorCode
from loraplex.ipc.protocol import (
    CacheHello,
    CacheStoreFull,
    EngineAdapterLoaded,
    EngineFailure,
    EngineLoadAdapter,
    EngineShutdown,
    EngineUnloadAdapter,
    Message,
)
from loraplex.ipc.sockets import TypedSocket

ROLE = "loraplex-cache-manager"
log = logging.getLogger(ROLE)


class CacheManager:
    def __init__(self, spec: EngineSpec) -> None:
        if not spec.host_store_segment:
            raise ValueError("the daemon names the store segment (spec.host_store_segment)")
        self.spec = resolve_spec(spec)  # model dir and dtype resolved exactly as the engines resolve them
        self.config = ModelConfig.from_dir(self.spec.model or "")
        # The engine's split (one rank when tensor_parallel_size is 1): its pages, hence the daemon's counts.
        self.split = TensorParallelPlan.configured(self.config, self.spec.tensor_parallel_size)
        self.geometry = self.split.geometry(self.spec.page_tokens)
        self.dtype = DTYPES[self.spec.dtype]
        self.roots = resolve_roots(self.spec.adapter_dirs)  # where adapter files may resolve
        # Never pinned here: this process has no CUDA context; each engine registers its own mapping.
        self.store = HostStore(spec.host_store_segment, spec.host_store_bytes, self.dtype, pin=False)

    def hello(self, demo: bool) -> CacheHello:
        demo_adapters: dict[str, str] = {}
        if demo:
            from loraplex.gpu_engine.demo import builtin_demo

            demo_adapters = {name: str(path) for name, path in builtin_demo().adapters.items()}
            self.roots = allow_also(self.roots, demo_adapters.values())  # its own adapters are always allowed
        return CacheHello(pid=os.getpid(), store_segment=self.store.name, capacity_bytes=self.store.arena.capacity,
                          dtype=self.spec.dtype, model_dir=str(self.spec.model), demo_adapters=demo_adapters)

    def handle(self, msg: Message) -> Message:
        if isinstance(msg, EngineLoadAdapter):
            return self.load(msg.name, msg.path)
        if isinstance(msg, EngineUnloadAdapter):
            self.store.remove(msg.name)
            return EngineAdapterLoaded(name=msg.name, rank=0, target_modules=[], num_pages=0, nbytes=0)
        return EngineFailure(code=ErrorCode.UNKNOWN_TYPE.value, message=f"cache manager cannot handle {msg.TYPE}")

    def load(self, name: str, path: str) -> Message:
        """Read and validate `path`, then place it in the store (replacing an entry of that name)."""
        try:
            adapter = load_peft_adapter(name, path, self.config, max_lora_rank=self.spec.max_lora_rank,
                                        dtype=self.dtype, roots=self.roots)
        except LoraplexRequestError as exc:
            return EngineFailure(code=exc.code, message=str(exc), subject=name)
        except OSError as exc:
            return EngineFailure(code=ErrorCode.INVALID_ADAPTER.value, message=str(exc), subject=name)
        shapes = self.config.adapter_shapes()
        try:
            pages = self.split.adapter_layout(self.geometry, adapter.spec.targets, adapter.spec.rank).num_pages
        except ValueError as exc:  # a target the engine's ranks do not split (lm_head, embed_tokens)
            return EngineFailure(code=ErrorCode.INVALID_ADAPTER.value, message=f"adapter {name}: {exc}", subject=name)
        try:
            entry = self.store.put(adapter, shapes, self.config.num_layers)
        except StoreFull:
            layout = store_entry_layout(name, adapter.spec.rank, {m: shapes[m] for m in adapter.spec.targets},
                                        self.config.num_layers, self.spec.dtype)
            arena = self.store.arena
            return CacheStoreFull(name=name, needed_bytes=ArenaAllocator.extent_size(layout.nbytes),
                                  free_bytes=arena.free_bytes, largest_free=arena.largest_free,
                                  rank=adapter.spec.rank, target_modules=list(adapter.spec.targets),
                                  num_pages=pages, nbytes=adapter.nbytes, scaling=adapter.spec.scaling)
        return EngineAdapterLoaded(name=name, rank=adapter.spec.rank, target_modules=list(adapter.spec.targets),
                                   num_pages=pages, nbytes=adapter.nbytes, store_entry=entry,
                                   scaling=adapter.spec.scaling)

    def close(self) -> None:
        self.store.close()  # the owner: unlinks the segment too


def serve(manager: CacheManager, sock: TypedSocket, demo: bool) -> None:
    try:
        sock.send(manager.hello(demo))
        while True:
            msg = sock.recv().message
            if isinstance(msg, EngineShutdown):
                return
            try:
                reply = manager.handle(msg)
            except Exception as exc:  # a bug in one order must not take the host tier down
                log.error("order %s failed: %s", msg.TYPE, traceback.format_exc())
                reply = EngineFailure(code=ErrorCode.INTERNAL.value, message=f"cache manager failed: {exc}")
            sock.send(reply)
    finally:
        manager.close()


def main(argv: list[str] | None = None) -> int:
    return run_child(ROLE, "cache manager", argv, CacheManager, serve)


if __name__ == "__main__":
    raise SystemExit(main())
