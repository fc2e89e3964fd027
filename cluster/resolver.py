"""At the ingress: where a request's adapter comes from and which content it must be served
with. A name the catalog holds (registered at the ingress) resolves to its registered location,
any other to the default adapter source (`--adapter-source`), and either to the digest of the
files there now, checked at most every `check_s` seconds (0: on every request), so that the
replica serving it loads exactly that content: an adapter replaced in its source is never served
stale once the ingress has seen the change. Names in neither are left to the replicas' daemons
(their own adapters, e.g. the demo ones); names removed at the ingress are refused.
"""
from __future__ import annotations

import asyncio
import time
from typing import Any

from loraplex.cluster.catalog import split_location
from loraplex.cluster.sources import AdapterSource, SourceError, open_source
from loraplex.ipc.errors import ErrorCode, LoraplexError

CATALOG_CHECK_S = 1.0  # how stale this ingress's copy of the catalog may be (other ingress replicas' changes)
MAX_DIGESTS = 100_000


class AdapterResolver:
    def __init__(self, board: Any, default_source: str | None, *, check_s: float = 0.0) -> None:
        self._board = board
        self._default = default_source
        self._check_s = check_s
        self._sources: dict[str, AdapterSource] = {}
        self._catalog: dict[str, Any] = {"epoch": -1, "entries": {}, "removed": []}
        self._catalog_at = float("-inf")
        self._digests: dict[tuple[str, str], tuple[float, str]] = {}

    def source(self, root: str) -> AdapterSource:
        if root not in self._sources:
            self._sources[root] = open_source(root)
        return self._sources[root]

    async def _refresh(self, force: bool = False) -> None:
        if not force and time.monotonic() - self._catalog_at < CATALOG_CHECK_S:
            return
        view = await self._board.catalog.remote(self._catalog["epoch"])
        if view is not None:
            self._catalog = view
        self._catalog_at = time.monotonic()

    async def _digest(self, root: str, key: str) -> str:
        cached = self._digests.get((root, key))
        if cached is not None and time.monotonic() - cached[0] < self._check_s:
            return cached[1]
        digest = await asyncio.to_thread(self.source(root).digest, key)
        if len(self._digests) >= MAX_DIGESTS:
            self._digests.clear()
        self._digests[(root, key)] = (time.monotonic(), digest)
        return digest

    async def resolve(self, name: str | None) -> dict[str, str] | None:
        """{"root", "key", "digest"} for `name`, or None when the replicas' daemons answer for it."""
        if not name:
            return None
        await self._refresh()
        if name in self._catalog["removed"]:
            raise LoraplexError(ErrorCode.UNKNOWN_ADAPTER, f"adapter {name!r} was removed from the cluster")
        entry = self._catalog["entries"].get(name)
        if entry is None and self._default is None:
            return None
        root, key = entry if entry is not None else (self._default, name)
        try:
            return {"root": root, "key": key, "digest": await self._digest(root, key)}
        except SourceError as exc:
            if entry is None:
                return None  # not in the default source: perhaps one of the daemons' own adapters
            raise LoraplexError(ErrorCode.INVALID_ADAPTER, f"adapter {name!r}: {exc}") from None

    async def register(self, name: str, location: str) -> dict[str, object]:
        """Register `name` cluster-wide at `location` (DIR/NAME or s3://bucket/prefix/NAME) once its
        files are there; every replica serves it from its next request on."""
        try:
            root, key = split_location(location)
            digest = await self._digest(root, key)
        except (ValueError, SourceError) as exc:
            raise LoraplexError(ErrorCode.INVALID_ADAPTER, f"adapter {name!r}: {exc}") from None
        await self._board.register.remote(name, root, key)
        await self._refresh(force=True)
        return {"name": name, "location": location, "digest": digest}

    async def knows(self, name: str) -> bool:
        """Whether `name` is registered at the ingress or in the default source (and not removed)."""
        await self._refresh(force=True)
        if name in self._catalog["removed"]:
            return False
        return name in self._catalog["entries"] or await self.resolve(name) is not None

    async def remove(self, name: str) -> dict[str, object]:
        """Remove `name` everywhere: refused here at once, unregistered by each replica's daemon
        within its next stats period."""
        await self._board.remove.remote(name)
        await self._refresh(force=True)
        return {"name": name, "removed": True}

    def removed(self) -> list[str]:
        return list(self._catalog["removed"])

    def registered(self) -> dict[str, str]:
        """name -> location of the adapters registered at the ingress (as last seen)."""
        return {n: f"{root}/{key}" for n, (root, key) in self._catalog["entries"].items()}
