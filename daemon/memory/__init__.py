"""Unified paged memory bookkeeping (torch-free): page geometry and the page allocator."""
from loraplex.daemon.memory.allocator import ADAPTER, KV, OutOfPages, PageAllocator, PoolUsage
from loraplex.daemon.memory.geometry import (
    AdapterLayout,
    PageGeometry,
    adapter_waste,
    kv_waste,
    plan_adapter_layout,
)

__all__ = [
    "ADAPTER", "KV", "AdapterLayout", "OutOfPages", "PageAllocator", "PageGeometry", "PoolUsage",
    "adapter_waste", "kv_waste", "plan_adapter_layout",
]
