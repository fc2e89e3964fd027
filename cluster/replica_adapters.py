"""On a replica: bring a cluster-wide adapter into its daemon at the content the ingress resolved
(resolver.py): fetch it from its source into the local disk tier (disk_tier.py) unless there,
register it with the daemon (replace=True: the daemon keeps every cached copy when the content
did not change, and swaps the weights without serving a mix when it did), and unregister the
adapters the ingress removed or the disk tier evicted.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from typing import Any

from loraplex.cluster.disk_tier import DiskTier
from loraplex.cluster.sources import AdapterSource, SourceError, open_source
from loraplex.ipc.client import AsyncAdminClient, LoraplexError
from loraplex.ipc.errors import ErrorCode

log = logging.getLogger("loraplex.cluster")
ADD_TIMEOUT_S = 120.0


class ReplicaAdapters:
    def __init__(self, admin: AsyncAdminClient, tier: DiskTier, busy: Callable[[], set[str]]) -> None:
        self._admin = admin
        self.tier = tier
        self._busy = busy  # names with requests in flight on this replica
        self._sources: dict[str, AdapterSource] = {}
        self._loaded: dict[str, str] = {}  # name -> digest registered with the daemon
        self._locks: dict[str, asyncio.Lock] = {}
        self._epoch = -1
        self._removed: set[str] = set()  # the tombstones already applied

    def _source(self, root: str) -> AdapterSource:
        if root not in self._sources:
            self._sources[root] = open_source(root)
        return self._sources[root]

    def _in_use(self, digest: str) -> bool:
        busy = self._busy()
        return any(d == digest and n in busy for n, d in self._loaded.items())

    async def ensure(self, name: str, ref: Mapping[str, str]) -> None:
        """The daemon serves `name` with the content `ref["digest"]` names (or newer) when this returns."""
        if self._loaded.get(name) == ref["digest"]:
            return
        lock = self._locks.setdefault(name, asyncio.Lock())
        async with lock:
            if self._loaded.get(name) == ref["digest"]:
                return
            try:
                source = self._source(ref["root"])
                path, digest, evicted = await asyncio.to_thread(
                    self.tier.get, ref["digest"], lambda tmp: source.fetch(ref["key"], tmp), self._in_use)
            except (SourceError, ValueError, OSError) as exc:
                raise LoraplexError(ErrorCode.INVALID_ADAPTER,
                                    f"adapter {name!r} could not be fetched: {exc}") from None
            await self._admin.add_adapter(name, str(path), replace=True, timeout=ADD_TIMEOUT_S)
            self._loaded[name] = digest
            for old in evicted:
                for stale in [n for n, d in self._loaded.items() if d == old]:
                    await self._unregister(stale, "its files left the disk tier")

    async def sync(self, catalog: Mapping[str, Any] | None) -> None:
        """Apply the ingress's removals (a catalog view from the board; None: unchanged)."""
        if catalog is None:
            return
        self._epoch = int(catalog["epoch"])
        removed = set(catalog["removed"])
        for name in sorted(removed - self._removed):  # the daemon's own adapters too
            await self._unregister(name, "it was removed at the ingress")
        self._removed = removed

    @property
    def epoch(self) -> int:
        return self._epoch

    async def _unregister(self, name: str, why: str) -> None:
        self._loaded.pop(name, None)
        try:
            await self._admin.remove_adapter(name)
            log.info("adapter %s unregistered: %s", name, why)
        except LoraplexError as exc:
            if exc.code is not ErrorCode.NOT_FOUND and exc.code is not ErrorCode.UNKNOWN_ADAPTER:
                log.warning("unregistering adapter %s failed: %s", name, exc)

