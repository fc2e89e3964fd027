"""The serving core's adapter administration: register, remove, list, and
replace an adapter's weights under the same name without stale copies.

Adapters are identified by the content hash of their files. A replacement
with new content waits until no request in flight uses the old weights (new
requests for the adapter are held meanwhile), then every engine re-reads the
files and every GPU copy is invalidated; unchanged content keeps the cached
copies. Torch-free; mixed into ServingCore (daemon/serving.py).
"""
from __future__ import annotations

import logging
from collections import Counter

from loraplex.daemon.adapter_table import AdapterEntry
from loraplex.daemon.child_link import EngineRefused
from loraplex.ipc.adapter_files import AdapterFileError
from loraplex.ipc.errors import ErrorCode

log = logging.getLogger("loraplex.daemon")


class Rejected(Exception):
    """A request or admin order is refused with a stable error code."""

    def __init__(self, code: ErrorCode | str, message: str) -> None:
        super().__init__(message)
        self.code = ErrorCode(code).value
        self.message = message


class AdapterAdmin:
    """Needs from its host class: adapters, slots, requests, load_mode, replicas, reader, on_identified,
    _adding, _held, _departed, and the host tier's (daemon/serving_host.py) cache, host_tier and its
    methods."""

    async def add_adapter(self, name: str, path: str, pinned: bool = False) -> AdapterEntry:
        if name in self.adapters or name in self._adding:
            raise Rejected(ErrorCode.ALREADY_EXISTS, f"adapter {name!r} is already registered")
        self._adding.add(name)  # admin orders run concurrently: a second add of this name waits for none
        try:
            return await self._add(AdapterEntry(name=name, path=path, pinned=pinned))
        finally:
            self._adding.discard(name)

    async def _add(self, entry: AdapterEntry) -> AdapterEntry:
        name = entry.name
        await self._identify(entry)
        if self.cache is not None:  # host store first (or on disk when it is full), then every engine
            await self._add_through_cache(entry)
        else:
            for slot in self.slots:
                if slot.link.alive():
                    await slot.load_adapter(entry)
                    if entry.state != "ready":
                        raise Rejected(ErrorCode.INVALID_ADAPTER, entry.error or "the engine refused the adapter")
        self.adapters.put(entry)
        self._keep_if_cached_mode(entry)
        return entry

    def _keep_if_cached_mode(self, entry: AdapterEntry) -> None:
        """cached mode: a ready adapter (in the host store, with one) is placed on every engine with
        the next step and kept for good."""
        if self.load_mode == "cached" and entry.state == "ready" and (self.cache is None or entry.store_entry):
            for slot in self.slots:
                if slot.scheduler is not None:
                    slot.scheduler.adapters.acquire(entry.name, entry.num_pages)

    async def _add_through_cache(self, entry: AdapterEntry) -> None:
        if entry.pinned:
            self.host_tier.pin(entry.name)
        code = ErrorCode.INVALID_ADAPTER
        try:
            await self._register_with_cache(entry)
        except EngineRefused as exc:
            entry.failed(str(exc))
            code = ErrorCode(exc.code) if exc.code == ErrorCode.FORBIDDEN_PATH.value else code
        if entry.state == "ready" and self._never_fits(entry):
            entry.failed(self._too_large_message(entry))
            code = ErrorCode.TOO_LARGE
        if entry.state != "ready":
            self.host_tier.unpin(entry.name)
            for slot in self.slots:
                await slot.unload_adapter(entry.name)
            await self._forget_in_cache(entry.name)
            raise Rejected(code, entry.error or "the adapter was refused")

    async def replace_adapter(self, name: str, path: str) -> tuple[AdapterEntry, bool]:
        """Serve the adapter at `path` as `name` (registering it if new). Returns (entry, changed):
        unchanged content (same hash) keeps every cached copy."""
        entry = self.adapters.get(name)
        if entry is None:
            return await self.add_adapter(name, path), True
        if entry.replacing:
            raise Rejected(ErrorCode.INVALID_FIELD, f"adapter {name!r} is already being replaced")
        fresh = AdapterEntry(name=name, path=path, pinned=entry.pinned)
        await self._identify(fresh)
        if not fresh.content_hash:
            raise Rejected(ErrorCode.INVALID_ADAPTER, f"the adapter files under {path} are missing")
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

    async def fits_model(self, name: str, path: str) -> bool:
        """Whether the adapter files at `path` may be read and load on this base model (checked under
        a scratch name; nothing is registered)."""
        probe = AdapterEntry(name=f"{name[:100]}.claim", path=path)
        try:
            await self._identify(probe)
            await self._validate_elsewhere(probe)
        except Rejected:
            return False
        return True

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
        if entry.replacing:
            raise Rejected(ErrorCode.INVALID_FIELD, f"adapter {name!r} is being replaced; remove it afterwards")
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
        listed = []
        for e in self.adapters.entries():
            on_gpu = any(r.is_resident(e.name) for r in residencies)
            tier = "gpu" if on_gpu else "host" if self._in_host_store(e.name) else "disk"
            listed.append(e.to_wire(resident=on_gpu, refs=sum(r.refs(e.name) for r in residencies), tier=tier))
        return listed

    def adapter_summary(self) -> dict[str, object]:
        """Counts per state and per tier (gpu, host, disk), for stats: the names stay in the adapter
        list (`loraplex adapters list --tier`), never in every snapshot. Cheap at 10,000 adapters."""
        by_state = Counter(e.state for e in self.adapters.values())
        on_gpu = {n for s in self.slots if s.scheduler is not None for n in s.scheduler.adapters.resident_names()
                  if n in self.adapters}
        host = 0 if self.host_tier is None else sum(1 for n in self.host_tier.resident_names() if n not in on_gpu)
        return {"total": len(self.adapters), **{state: by_state[state] for state in ("registered", "ready", "error")},
                "tiers": {"gpu": len(on_gpu), "host": host, "disk": len(self.adapters) - len(on_gpu) - host}}

    async def _identify(self, entry: AdapterEntry) -> None:
        """Hash the entry's files (off the loop, with a deadline). Rejected when they may not or cannot
        be read: never a regular file's stand-in, never outside the allowed directories."""
        try:
            entry.fingerprint, entry.content_hash = await self.reader.identify(entry.path)
        except AdapterFileError as exc:
            raise Rejected(exc.code, str(exc)) from None

    async def _ensure_identified(self, entry: AdapterEntry) -> None:
        """Before a lazy load: trust the recorded hash while the files' sizes and mtimes are unchanged,
        else hash them again (and record it). Rejected as _identify."""
        try:
            fingerprint = await self.reader.fingerprint(entry.path)
        except AdapterFileError as exc:
            raise Rejected(exc.code, str(exc)) from None
        if entry.content_hash and fingerprint == entry.fingerprint:
            return
        await self._identify(entry)
        if self.on_identified is not None:
            self.on_identified(entry)

    async def files_changed(self, name: str, path: str) -> bool:
        """Cheap check (sizes, mtimes, path) whether `name` may need replacing."""
        entry = self.adapters.get(name)
        if entry is None or entry.path != path:
            return True
        if entry.state == "registered":
            return False  # never loaded: nothing stale to replace, the first load reads what is there
        try:
            return await self.reader.fingerprint(path) != entry.fingerprint
        except AdapterFileError:
            return True  # replacing reports why it cannot read them
