"""The daemon's side of the cache manager process: an EngineLink whose child is
`loraplex-cache-manager` and whose hello is CacheHello.

Each start names a fresh store segment (one per generation): engines still
hold views of a dead cache manager's store, and a new name is how they tell
the new store from the old one. Torch-free.
"""
from __future__ import annotations

from loraplex.daemon.engine_link import EngineLink
from loraplex.ipc.protocol import CacheHello
from loraplex.ipc.shm import segment_name


class CacheManagerLink(EngineLink):
    CHILD_MODULE = "loraplex.gpu_engine.cache_manager_process"
    ENDPOINT_NAME = "cache"
    HELLO_TYPE = CacheHello

    async def start(self) -> CacheHello:
        instance = self.spec.get("shm_instance") or "daemon"
        self.spec = {**self.spec, "host_store_segment": segment_name(instance, f"store-g{self.starts}")}
        return await super().start()

    @property
    def segment(self) -> str:
        return self.hello.store_segment if self.hello is not None else ""
