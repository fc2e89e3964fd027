"""Messages between the daemon and the cache manager process (private socket).

Owns the declarations only: the cache manager's hello (its host store segment)
and its answer to a load the store cannot hold. Loads and unloads reuse the
engine's adapter messages (EngineLoadAdapter / EngineAdapterLoaded /
EngineUnloadAdapter / EngineFailure); tensors never travel here.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from loraplex.ipc.messages.base import Message, register
from loraplex.ipc.messages.checks import Name


@register
@dataclass(frozen=True, slots=True)
class CacheHello(Message):
    """First message of a started cache manager: the host store it owns."""

    TYPE = "cache_hello"
    pid: int
    store_segment: str  # shared-memory name; engines and CPU workers attach it read-only
    capacity_bytes: int  # arena bytes adapters can occupy
    dtype: str  # element type of the stored A / B^T blocks
    model_dir: str
    demo_adapters: dict[str, str] = field(default_factory=dict)  # name -> dir, when serving the demo model


@register
@dataclass(frozen=True, slots=True)
class CacheStoreFull(Message):
    """Reply to a load: the adapter is valid (its dimensions are here) but the store has
    no extent of `needed_bytes` now. The daemon evicts host-tier victims and retries,
    or keeps the adapter on disk."""

    TYPE = "cache_store_full"
    name: Name
    needed_bytes: int  # the extent the adapter takes
    free_bytes: int
    largest_free: int
    rank: int
    target_modules: list[str]
    num_pages: int
    nbytes: int
    scaling: float = 1.0
