"""Adapter administration: register, remove, list and pin adapters, and replace an adapter's
weights under the same name without stale copies.

Adapters are identified by the content hash of their files. A replacement with new content
waits until no request in flight uses the old weights (new requests for the adapter are held
meanwhile), then every engine re-reads the files and every GPU copy is invalidated; unchanged
content keeps the cached copies. Torch-free.
"""
from __future__ import annotations

import logging
from collections import Counter

from loraplex.daemon.adapter_identity import AdapterIdentity
from loraplex.daemon.adapter_table import AdapterEntry, AdapterTable
from loraplex.daemon.child_link import EngineRefused
from loraplex.daemon.engine_supervisor import EngineSupervisor
from loraplex.daemon.held_requests import HeldRequests
from loraplex.daemon.host_loads import HostLoader
from loraplex.daemon.host_service import HostTierService
from loraplex.daemon.rejected import Rejected
from loraplex.daemon.request_table import RequestTable
from loraplex.ipc.errors import ErrorCode

log = logging.getLogger("loraplex.daemon")


class AdapterAdmin:
    def __init__(self, adapters: AdapterTable, engines: EngineSupervisor, requests: RequestTable,
                 held: HeldRequests, identity: AdapterIdentity, host: HostTierService | None = None,
                 loader: HostLoader | None = None) -> None:
        self.adapters = adapters
        self.engines = engines
        self.requests = requests
        self.held = held
        self.identity = identity
        self.host = host  # None: no cache manager, each engine reads adapters from disk itself
        self.loader = loader
        self._adding: set[str] = set()  # names whose add is in progress

    # ---- register ------------------------------------------------------------------------------
    async def add(self, name: str, path: str, pinned: bool = False) -> AdapterEntry:
        if name in self.adapters or name in self._adding:
            raise Rejected(ErrorCode.ALREADY_EXISTS, f"adapter {name!r} is already registered")
        self._adding.add(name)  # admin orders run concurrently: a second add of this name waits for none
        try:
            entry = AdapterEntry(name=name, path=path, pinned=pinned)
            await self.identity.identify(entry)
            if self.host is not None:  # host store first (or on disk when it is full), then every engine
                await self.host.add(entry)
            else:
                await self._load_on_engines(entry)
            self.adapters.put(entry)
            self.keep_for_cached_mode(entry)
            return entry
        finally:
            self._adding.discard(name)

    async def _load_on_engines(self, entry: AdapterEntry) -> None:
        for slot in self.engines.slots:
            if slot.link.alive():
                await slot.load_adapter(entry)
                if entry.state != "ready":
                    raise Rejected(ErrorCode.INVALID_ADAPTER, entry.error or "the engine refused the adapter")

    def keep_for_cached_mode(self, entry: AdapterEntry) -> None:
        self.engines.keep_for_cached_mode(entry, in_store=self.host is None or bool(entry.store_entry))

    async def fits_model(self, name: str, path: str) -> bool:
        """Whether the adapter files at `path` may be read and load on this base model (checked under
        a scratch name; nothing is registered)."""
        probe = AdapterEntry(name=f"{name[:100]}.claim", path=path)
        try:
            await self.identity.identify(probe)
            await self._validate_elsewhere(probe)
        except Rejected:
            return False
        return True

    async def _validate_elsewhere(self, fresh: AdapterEntry) -> None:
        """Have one engine (or the cache manager) check the new files under a scratch name, so bad
        files never disturb the adapter being served."""
        if self.host is not None:
            try:
                await self.host.validate(f"{fresh.name}.replacing", fresh.path)
            except EngineRefused as exc:
                raise Rejected(ErrorCode.INVALID_ADAPTER, str(exc)) from None
            return
        slot = next((s for s in self.engines.slots if s.link.alive()), None)
        if slot is None:
            return
        probe = AdapterEntry(name=f"{fresh.name}.replacing", path=fresh.path)
        await slot.load_adapter(probe)
        await slot.unload_adapter(probe.name)
        if probe.state != "ready":
            raise Rejected(ErrorCode.INVALID_ADAPTER, probe.error or "the engine refused the adapter")

    # ---- replace -------------------------------------------------------------------------------
    async def replace(self, name: str, path: str) -> tuple[AdapterEntry, bool]:
        """Serve the adapter at `path` as `name` (registering it if new). Returns (entry, changed):
        unchanged content (same hash) keeps every cached copy."""
        entry = self.adapters.get(name)
        if entry is None:
            return await self.add(name, path), True
        if entry.replacing:
            raise Rejected(ErrorCode.INVALID_FIELD, f"adapter {name!r} is already being replaced")
        fresh = AdapterEntry(name=name, path=path, pinned=entry.pinned)
        await self.identity.identify(fresh)
        if not fresh.content_hash:
            raise Rejected(ErrorCode.INVALID_ADAPTER, f"the adapter files under {path} are missing")
        if fresh.content_hash == entry.content_hash and entry.state == "ready":
            entry.path, entry.fingerprint = path, fresh.fingerprint
            return entry, False
        await self._validate_elsewhere(fresh)
        entry.replacing = True
        try:
            while self._users(name):  # requests running with the old weights finish with them
                self.requests.departed.clear()
                await self.requests.departed.wait()
            entry.path, entry.content_hash, entry.fingerprint = path, fresh.content_hash, fresh.fingerprint
            await self._reload(entry)
            log.info("adapter %s replaced (content %s)", name, entry.content_hash[:12])
        finally:
            entry.replacing = False
            self._release(name)
        return entry, True

    def _users(self, name: str) -> list[str]:
        held = set(self.held.waiting(name))
        return [key for key in self.requests.users(name) if key not in held]

    async def _reload(self, entry: AdapterEntry) -> None:
        """Every copy of the old weights goes: GPU copies (unreferenced now, so freed at once), then
        the engines' (or the host store's) copy is read again from the new files."""
        for slot in self.engines.slots:
            if slot.scheduler is not None:
                slot.scheduler.adapters.invalidate(entry.name)
            if slot.link.alive() and self.host is None:
                await slot.load_adapter(entry)  # the engine drops its old host and GPU copies
        if self.host is not None:
            await self.host.reload(entry)

    def _release(self, name: str) -> None:
        """After a replacement: route the held requests, or load the adapter for them first."""
        if self.loader is not None and self.host.needs_load(name) and self.held.waiting(name):
            self.loader.load_for_held(name)
        else:
            self.held.release(name)

    async def files_changed(self, name: str, path: str) -> bool:
        """Cheap check (sizes, mtimes, path) whether `name` may need replacing."""
        entry = self.adapters.get(name)
        return entry is None or await self.identity.changed(entry, path)

    # ---- remove, pin, list -----------------------------------------------------------------------
    def check_removable(self, name: str) -> None:
        """Rejected unless `remove(name)` would go ahead now (the registry is changed first, then memory)."""
        entry = self.adapters.get(name)
        if entry is None:
            raise Rejected(ErrorCode.NOT_FOUND, f"unknown adapter {name!r}")
        if entry.replacing:
            raise Rejected(ErrorCode.INVALID_FIELD, f"adapter {name!r} is being replaced; remove it afterwards")
        users = self.requests.users(name)
        if users:
            raise Rejected(ErrorCode.INVALID_FIELD, f"adapter {name!r} is used by {len(users)} requests in flight")

    async def remove(self, name: str) -> None:
        self.check_removable(name)
        self.adapters.pop(name)
        await self.engines.unload(name)
        if self.host is not None:  # after the engines: none may read a freed extent
            await self.host.forget(name)

    def pin(self, name: str, pinned: bool) -> None:
        if self.host is not None:
            self.host.pin(name, pinned)
        self.engines.pin(name, pinned)

    def listing(self) -> list[dict[str, object]]:
        residencies = [sched.adapters for sched in self.engines.schedulers()]
        listed = []
        for e in self.adapters.entries():
            on_gpu = any(r.is_resident(e.name) for r in residencies)
            tier = "gpu" if on_gpu else "host" if self.host is not None and self.host.is_resident(e.name) else "disk"
            listed.append(e.to_wire(resident=on_gpu, refs=sum(r.refs(e.name) for r in residencies), tier=tier))
        return listed

    def summary(self) -> dict[str, object]:
        """Counts per state and per tier (gpu, host, disk), for stats: the names stay in the adapter
        list (`loraplex adapters list --tier`), never in every snapshot. Cheap at 10,000 adapters."""
        by_state = Counter(e.state for e in self.adapters.values())
        on_gpu = {n for sched in self.engines.schedulers() for n in sched.adapters.resident_names()
                  if n in self.adapters}
        tier = self.host.tier if self.host is not None else None
        host = 0 if tier is None else sum(1 for n in tier.resident_names() if n not in on_gpu)
        return {"total": len(self.adapters), **{state: by_state[state] for state in ("registered", "ready", "error")},
                "tiers": {"gpu": len(on_gpu), "host": host, "disk": len(self.adapters) - len(on_gpu) - host}}
