"""The serving core's adapter administration: register, remove, list, and
replace an adapter's weights under the same name without stale copies.

Adapters are identified by the content hash of their files. A replacement
with new content waits until no request in flight uses the old weights (new
requests for the adapter are held meanwhile), then every engine re-reads the
files and every GPU copy is invalidated; unchanged content keeps the cached
copies. Torch-free; mixed into ServingCore (daemon/serving.py).
"""
from __future__ import annotations

import asyncio
import logging

from loraplex.daemon.adapter_hash import adapter_content_hash, adapter_fingerprint
from loraplex.daemon.adapter_table import AdapterEntry
from loraplex.daemon.engine_link import EngineRefused
from loraplex.ipc.errors import ErrorCode

log = logging.getLogger("loraplex.daemon")


class Rejected(Exception):
    """A request or admin order is refused with a stable error code."""

    def __init__(self, code: ErrorCode | str, message: str) -> None:
        super().__init__(message)
        self.code = ErrorCode(code).value
        self.message = message


class AdapterAdmin:
    """Needs from its host class: adapters, slots, requests, load_mode, replicas, _held, _departed,
    and the host tier's (daemon/serving_host.py) cache, host_tier and its methods."""

    async def add_adapter(self, name: str, path: str, pinned: bool = False) -> AdapterEntry:
        if name in self.adapters:
            raise Rejected(ErrorCode.ALREADY_EXISTS, f"adapter {name!r} is already registered")
        entry = AdapterEntry(name=name, path=path, pinned=pinned)
        await _hash_into(entry)
        if self.cache is not None:  # host store first (or on disk when it is full), then every engine
            await self._add_through_cache(entry)
        else:
            for slot in self.slots:
                if slot.link.alive():
                    await slot.load_adapter(entry)
                    if entry.state != "ready":
                        raise Rejected(ErrorCode.INVALID_ADAPTER, entry.error or "the engine refused the adapter")
        self.adapters.put(entry)
        if self.load_mode == "cached" and entry.state == "ready" and (self.cache is None or entry.store_entry):
            for slot in self.slots:  # placed with the next step, kept for good
                if slot.scheduler is not None:
                    slot.scheduler.adapters.acquire(name, entry.num_pages)
        return entry

    async def _add_through_cache(self, entry: AdapterEntry) -> None:
        if entry.pinned:
            self.host_tier.pin(entry.name)
        try:
            await self._register_with_cache(entry)
        except EngineRefused as exc:
            entry.failed(str(exc))
        if entry.state != "ready":
            self.host_tier.unpin(entry.name)
            for slot in self.slots:
                await slot.unload_adapter(entry.name)
            await self._forget_in_cache(entry.name)
            raise Rejected(ErrorCode.INVALID_ADAPTER, entry.error or "the adapter was refused")

    async def replace_adapter(self, name: str, path: str) -> tuple[AdapterEntry, bool]:
        """Serve the adapter at `path` as `name` (registering it if new). Returns (entry, changed):
        unchanged content (same hash) keeps every cached copy."""
        entry = self.adapters.get(name)
        if entry is None:
            return await self.add_adapter(name, path), True
        if entry.replacing:
            raise Rejected(ErrorCode.INVALID_FIELD, f"adapter {name!r} is already being replaced")
        fresh = AdapterEntry(name=name, path=path, pinned=entry.pinned)
        await _hash_into(fresh)
        if not fresh.content_hash:
            raise Rejected(ErrorCode.INVALID_ADAPTER, f"cannot read the adapter files under {path}")
        if fresh.content_hash == entry.content_hash and entry.state == "ready":
            entry.path, entry.fingerprint = path, fresh.fingerprint
            return entry, False
        await self._validate_elsewhere(fresh)
        entry.replacing = True
        try:
            while self._users(name):  # requests running with the old weights finish with them
                self._departed.clear()
                await self._departed.wait()
            entry.path, entry.content_hash, entry.fingerprint = path, fresh.content_hash, fresh.fingerprint
            for slot in self.slots:
                if slot.scheduler is not None:
                    slot.scheduler.adapters.invalidate(name)  # unreferenced now, so freed at once
                if slot.link.alive() and self.cache is None:
                    await slot.load_adapter(entry)  # the engine drops its old host and GPU copies
            if self.cache is not None:
                await self._reload_in_cache(entry)
            log.info("adapter %s replaced (content %s)", name, entry.content_hash[:12])
        finally:
            entry.replacing = False
            self._release_or_load(name)
        return entry, True

    async def _validate_elsewhere(self, fresh: AdapterEntry) -> None:
        """Have one engine check the new files under a scratch name, so bad files never
        disturb the adapter being served."""
        if self.cache is not None:
            try:
                await self._validate_in_cache(f"{fresh.name}.replacing", fresh.path)
            except EngineRefused as exc:
                raise Rejected(ErrorCode.INVALID_ADAPTER, str(exc)) from None
            return
        slot = next((s for s in self.slots if s.link.alive()), None)
        if slot is None:
            return
        probe = AdapterEntry(name=f"{fresh.name}.replacing", path=fresh.path)
        await slot.load_adapter(probe)
        await slot.unload_adapter(probe.name)
        if probe.state != "ready":
            raise Rejected(ErrorCode.INVALID_ADAPTER, probe.error or "the engine refused the adapter")

    def _users(self, name: str) -> list[str]:
        held = {seq.request_id for seq in self._held.get(name, [])}
        return [key for key, state in self.requests.items() if state.msg.adapter == name and key not in held]

    def _release_held(self, name: str) -> None:
        for seq in self._held.pop(name, []):
            if seq.request_id in self.requests:
                slot = self.replicas.choose(seq, self.adapters)
                self.requests[seq.request_id].engine = slot.index
                slot.enqueue(seq)

    async def remove_adapter(self, name: str) -> None:
        entry = self.adapters.get(name)
        if entry is None:
            raise Rejected(ErrorCode.NOT_FOUND, f"unknown adapter {name!r}")
        users = [s for s in self.requests.values() if s.msg.adapter == name]
        if users:
            raise Rejected(ErrorCode.INVALID_FIELD, f"adapter {name!r} is used by {len(users)} requests in flight")
        self.adapters.pop(name)
        for slot in self.slots:
            await slot.unload_adapter(name)
        if self.cache is not None:  # after the engines: none may read a freed extent
            await self._forget_in_cache(name)

    def adapter_list(self) -> list[dict[str, object]]:
        residencies = [s.scheduler.adapters for s in self.slots if s.scheduler is not None]
        return [e.to_wire(resident=any(r.is_resident(e.name) for r in residencies),
                          refs=sum(r.refs(e.name) for r in residencies)) for e in self.adapters.entries()]

    async def hash_adapters(self) -> None:
        """Hash the files of adapters registered without a hash (at start, the demo's)."""
        for entry in self.adapters.entries():
            if not entry.content_hash:
                await _hash_into(entry)

    def files_changed(self, name: str, path: str) -> bool:
        """Cheap check (sizes, mtimes, path) whether `name` may need replacing."""
        entry = self.adapters.get(name)
        return entry is None or entry.path != path or adapter_fingerprint(path) != entry.fingerprint


async def _hash_into(entry: AdapterEntry) -> None:
    entry.fingerprint = await asyncio.to_thread(adapter_fingerprint, entry.path)
    entry.content_hash = await asyncio.to_thread(adapter_content_hash, entry.path)
