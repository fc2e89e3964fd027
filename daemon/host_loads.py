"""Loads into the host store that nobody waits on an admin socket for: an adapter still on disk
that requests wait for (they are held, then routed once it is in, or failed with why), and
the background warm-up that fills the store after start, pinned and most used first.

Torch-free. Files are hashed outside the host tier's lock, so a slow file holds up no other load.
"""
from __future__ import annotations

import asyncio
import logging
from enum import Enum

from loraplex.daemon.adapter_identity import AdapterIdentity
from loraplex.daemon.adapter_table import AdapterEntry, AdapterTable
from loraplex.daemon.child_link import EngineDied, EngineRefused
from loraplex.daemon.controls import Controls
from loraplex.daemon.engine_supervisor import EngineSupervisor
from loraplex.daemon.held_requests import HeldRequests
from loraplex.daemon.host_service import HostTierService
from loraplex.daemon.rejected import Rejected
from loraplex.daemon.request_table import RequestTable
from loraplex.daemon.scheduler.sequence import SeqRequest
from loraplex.ipc.errors import ErrorCode

log = logging.getLogger("loraplex.daemon.host")
ROOM_RECHECK_S = 2.0  # a request held for host room retries at least this often
CHILD_RETRY_S = 0.5  # a load that met a child between starts is tried again this soon


class _Attempt(Enum):
    DONE = "done"  # the held requests were routed, or failed with why
    NO_ROOM = "no_room"  # the store is full of adapters in use: tried again when a request leaves
    RESTARTING = "restarting"  # the cache manager died under the load: tried again once it is back


class HostLoader:
    def __init__(self, host: HostTierService, engines: EngineSupervisor, adapters: AdapterTable,
                 requests: RequestTable, held: HeldRequests, identity: AdapterIdentity, controls: Controls) -> None:
        self.host = host
        self.engines = engines
        self.adapters = adapters
        self.requests = requests
        self.held = held
        self.identity = identity
        self.controls = controls
        self._loads: dict[str, asyncio.Task] = {}  # adapter -> its load for the requests held for it
        self._warming: asyncio.Task | None = None

    # ---- requests for adapters on disk -----------------------------------------------------
    def hold(self, name: str, seq: SeqRequest) -> None:
        """`seq` waits for `name` to reach the host store; it is routed once it is there."""
        self.held.hold(name, seq)
        self.load_for_held(name)

    def load_for_held(self, name: str) -> None:
        if name not in self._loads:
            self._loads[name] = asyncio.create_task(self._bring_to_host(name), name=f"host-load-{name}")

    async def cancel_loads(self) -> None:
        tasks = list(self._loads.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _bring_to_host(self, name: str) -> None:
        """Load `name` for the requests held for it, then route them. While adapters of requests
        in flight fill the store, retry whenever a request leaves; fail the held requests when
        the files are bad or the adapter can never fit (the entry is marked `error` then)."""
        try:
            while self.held.any_in_flight(name):
                entry = self.adapters.get(name)
                if entry is None:
                    await self._fail(name, ErrorCode.UNKNOWN_ADAPTER, f"adapter {name!r} was removed")
                    return
                self.requests.departed.clear()
                outcome = await self._try_load(entry)
                if outcome == _Attempt.DONE:
                    return
                if outcome == _Attempt.RESTARTING:  # the cache manager is restarting: no departure is needed
                    await asyncio.sleep(CHILD_RETRY_S)
                    continue
                log.info("host store full of adapters in use; %s waits for a request to finish", name)
                try:  # bounded: another waiter's clear() may have swallowed the departure meant for us
                    await asyncio.wait_for(self.requests.departed.wait(), ROOM_RECHECK_S)
                except asyncio.TimeoutError:
                    pass
        finally:
            self._loads.pop(name, None)

    async def _try_load(self, entry: AdapterEntry) -> _Attempt:
        """One attempt to bring `entry` into the host store for its held requests (_Attempt says
        what came of it). A cache manager that died under the load is being restarted: the
        requests wait for it, bounded by their own deadlines, and never fail for it (an engine
        lost meanwhile is no reason to wait either, see EngineSupervisor.load)."""
        name = entry.name
        try:
            await self.identity.ensure_identified(entry)  # off the lock: a slow file holds up no other load
        except Rejected as exc:
            entry.failed(exc.message)
            await self._fail(name, ErrorCode(exc.code), f"adapter {name!r} cannot be loaded: {exc.message}")
            return _Attempt.DONE
        try:
            async with self.host.lock:
                admitted = await self.host.admit(entry, evict=True)
                if admitted:
                    await self.engines.load(entry, keep_resident=True)
        except EngineRefused as exc:
            entry.failed(str(exc))  # listed as `error` with its reason; new requests are refused at once
            code = ErrorCode.FORBIDDEN_PATH if exc.code == ErrorCode.FORBIDDEN_PATH.value else ErrorCode.INVALID_ADAPTER
            await self._fail(name, code, f"adapter {name!r} cannot be loaded: {exc}")
            return _Attempt.DONE
        except EngineDied as exc:
            log.warning("loading %s met the cache manager between starts (%s); its requests wait", name, exc)
            return _Attempt.RESTARTING
        if entry.state != "ready":
            await self._fail(name, ErrorCode.INVALID_ADAPTER, entry.error or "the engine refused it")
            return _Attempt.DONE
        if admitted:
            self.held.release(name)
            return _Attempt.DONE
        if self.host.never_fits(entry):
            entry.failed(self.host.too_large_message(entry))
            await self._fail(name, ErrorCode.TOO_LARGE, entry.error)
            return _Attempt.DONE
        return _Attempt.NO_ROOM

    async def _fail(self, name: str, code: ErrorCode, message: str) -> None:
        self.host.tier.failures += 1
        await self.held.fail(name, code, message)

    # ---- the background warm-up -------------------------------------------------------------
    def start_warming(self) -> None:
        """After start: fill the host store from disk in the background, pinned and most used first."""
        if self._warming is None or self._warming.done():
            self._warming = asyncio.create_task(self.warm(), name="host-warm-up")

    async def stop_warming(self) -> None:
        if self._warming is not None:
            self._warming.cancel()
            await asyncio.gather(self._warming, return_exceptions=True)
            self._warming = None

    async def warm(self) -> None:
        """Validate and load registered adapters into the host store one at a time, never evicting:
        stop at the first that finds no room (the rest load when a request needs them). A bad one
        is marked `error` with its reason. Requests' own loads go first: each step takes the lock
        briefly and the files are hashed outside it."""
        order = sorted(self.adapters.entries(), key=lambda e: (not e.pinned, -(e.uses + e.requests), e.name))
        warmed = 0
        for entry in order:
            if not self._worth_warming(entry):
                continue
            try:
                await self.identity.ensure_identified(entry)
            except Rejected as exc:
                entry.failed(exc.message)
                log.warning("adapter %s: %s", entry.name, exc.message)
                continue
            try:
                outcome = await self._warm_one(entry)
            except EngineDied:
                return  # the cache manager's recovery reloads what was in use
            if outcome == "full":
                break
            warmed += outcome == "loaded"
        log.info("host store warmed: %d adapters loaded in the background (%d resident)", warmed,
                 len(self.host.tier.resident_names()))

    def _worth_warming(self, entry: AdapterEntry) -> bool:
        return not (self.controls.draining or self.adapters.get(entry.name) is not entry or entry.state == "error"
                    or entry.replacing or self.host.is_resident(entry.name))

    async def _warm_one(self, entry: AdapterEntry) -> str:
        """loaded, skipped (gone, already in, or bad files: marked), or full (no room)."""
        async with self.host.lock:
            if self.adapters.get(entry.name) is not entry or self.host.is_resident(entry.name):
                return "skipped"
            try:
                admitted = await self.host.admit(entry, evict=False)
            except EngineRefused as exc:
                entry.failed(str(exc))
                log.warning("adapter %s cannot be served: %s", entry.name, exc)
                return "skipped"
            if admitted:
                await self.engines.load(entry, keep_resident=True)
                self.engines.keep_for_cached_mode(entry, in_store=bool(entry.store_entry))
                return "loaded"
            if self.host.never_fits(entry):
                entry.failed(self.host.too_large_message(entry))
                return "skipped"
            return "full"
