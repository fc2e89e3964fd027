"""The daemon's side of the cache manager process (`loraplex-cache-manager`): a ChildLink
whose child runs gpu_engine/cache_manager_process.py and answers with a CacheHello.

Each start names a fresh store segment (one per generation): engines still hold views of a
dead cache manager's store, and a new name is how they tell the new store from the old one.
Torch-free.
"""
from __future__ import annotations

from dataclasses import replace

from loraplex.contracts.engine_spec import EngineSpec
from loraplex.daemon.child_link import ChildLink
from loraplex.ipc.protocol import CacheHello
from loraplex.ipc.shm import segment_name


class CacheManagerLink(ChildLink):
    CHILD_MODULE = "loraplex.gpu_engine.cache_manager_process"
    ENDPOINT_NAME = "cache"
    HELLO_TYPE = CacheHello

    def child_spec(self) -> EngineSpec:
        """The store this generation of the cache manager creates."""
        instance = self.spec.shm_instance or "daemon"
        return replace(self.spec, host_store_segment=segment_name(instance, f"store-g{self.starts}"))

    @property
    def segment(self) -> str:
        return self.hello.store_segment if self.hello is not None else ""
