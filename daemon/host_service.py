"""The host tier as the serving core runs it: the cache manager process (disk -> host store),
which adapters sit in its store, eviction when the store is full, and a new cache manager
when one dies.

Torch-free. Every load is awaited over the cache manager's socket, so the event loop never
blocks on disk. One host-tier change runs at a time (`lock`). Engines always drop an adapter
before the store frees it, so no engine ever reads a freed extent.
"""
from __future__ import annotations

import asyncio
import logging
import time

from loraplex.daemon.adapter_hash import AdapterReader
from loraplex.daemon.adapter_table import AdapterEntry, AdapterTable
from loraplex.daemon.cache_link import CacheManagerLink
from loraplex.daemon.child_link import EngineDied, EngineRefused
from loraplex.daemon.engine_supervisor import MAX_RESTART_DELAY_S, EngineSupervisor
from loraplex.daemon.host_tier import HostTier
from loraplex.daemon.rejected import Rejected
from loraplex.daemon.request_table import RequestTable
from loraplex.ipc.adapter_files import allow_also
from loraplex.ipc.adapter_store import ArenaAllocator
from loraplex.ipc.errors import ErrorCode
from loraplex.ipc.protocol import EngineAdapterLoaded, EngineLoadAdapter, EngineUnloadAdapter, Message

log = logging.getLogger("loraplex.daemon.host")


class HostTierService:
    def __init__(self, link: CacheManagerLink, adapters: AdapterTable, engines: EngineSupervisor,
                 requests: RequestTable, reader: AdapterReader) -> None:
        self.link = link
        self.adapters = adapters
        self.engines = engines
        self.requests = requests
        self.reader = reader
        self.tier: HostTier | None = None  # the store's bookkeeping, once the cache manager said its size
        self.lock = asyncio.Lock()  # held by every change of the host tier
        self._recovery: asyncio.Task | None = None

    # ---- the cache manager process ---------------------------------------------------------
    async def start(self) -> None:
        """Start the cache manager (before any engine); its store becomes the engines' store."""
        hello = await self.link.start()
        if self.tier is None:
            self.tier = HostTier(hello.capacity_bytes)
        self.tier.capacity = hello.capacity_bytes
        self.engines.attach_store(hello.store_segment)
        for name, path in hello.demo_adapters.items():  # the built-in demo's adapters, serving without --model
            if name not in self.adapters:
                self.adapters.put(AdapterEntry(name=name, path=path))
        self.reader.roots = allow_also(self.reader.roots, hello.demo_adapters.values())
        self.link.on_lost = self._on_lost
        log.info("cache manager up (pid %s): host store %s, %.1f MB", self.link.pid, hello.store_segment,
                 hello.capacity_bytes / 1e6)

    async def stop(self) -> None:
        self.link.on_lost = None
        if self._recovery is not None:
            self._recovery.cancel()
            await asyncio.gather(self._recovery, return_exceptions=True)
        await self.link.stop()

    def _on_lost(self) -> None:
        if self._recovery is None or self._recovery.done():
            self._recovery = asyncio.ensure_future(self._recover_if_dead())

    async def _recover_if_dead(self) -> None:
        async with self.lock:
            if not self.link.alive():
                await self._recover(self.link.lost_reason or "the cache manager exited")

    async def _recover(self, reason: str) -> None:
        """Restart a dead cache manager (caller holds the lock). Its store is gone, but engines
        still map it, so what they hold keeps serving; the adapters in use (then the most
        recent) are reloaded into the new store and engines rebind to it, keeping their GPU
        copies. What does not fit leaves the engines unless a request in flight uses it."""
        log.error("cache manager lost: %s; restarting it", reason)
        previous = self.tier.resident_names()  # least recently used first
        self.tier.reset()
        for entry in self.adapters.entries():
            entry.store_entry = None
        await self._restart()
        busy = self.busy_adapters()
        order = [n for n in reversed(previous) if n in busy] + [n for n in reversed(previous) if n not in busy]
        for name in order:
            entry = self.adapters.get(name)
            if entry is None:
                continue
            try:
                admitted = await self.admit(entry, evict=False, recovering=True)
            except (EngineDied, EngineRefused) as exc:
                log.warning("adapter %s not reloaded after the cache manager restart: %s", name, exc)
                admitted = False
            if admitted:
                await self.engines.load(entry, keep_resident=True)
            elif name not in self.busy_adapters():
                await self.engines.drop(name)
        log.info("cache manager restarted; %d adapters back in the host store", len(self.tier.resident_names()))

    async def _restart(self) -> None:
        delay = 0.5
        while True:
            try:
                await self.start()
                return
            except (EngineDied, EngineRefused, OSError) as exc:
                log.error("cache manager restart failed: %s; retrying in %.1f s", exc, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, MAX_RESTART_DELAY_S)

    async def call(self, order: Message, *, recovering: bool = False) -> Message:
        """One order to the cache manager (caller holds the lock); a dead one is restarted and
        the order retried once. EngineRefused: the cache manager refused it."""
        try:
            return await self.link.call(order)
        except EngineDied as exc:
            if recovering:
                raise
            await self._recover(str(exc))
        return await self.link.call(order)

    # ---- what sits in the store ------------------------------------------------------------
    def is_resident(self, name: str) -> bool:
        return self.tier is not None and self.tier.is_resident(name)

    def needs_load(self, name: str) -> bool:
        return self.tier is not None and not self.tier.is_resident(name)

    def pin(self, name: str, pinned: bool) -> None:
        if self.tier is not None:
            (self.tier.pin if pinned else self.tier.unpin)(name)

    def note_tier(self, name: str) -> None:
        """Count where a request found its adapter (GPU, host store or disk)."""
        tier = "gpu" if self.engines.on_gpu(name) else "host" if self.tier.is_resident(name) else "disk"
        self.tier.record_hit(tier)
        self.tier.touch(name)

    def busy_adapters(self) -> set[str]:
        """Adapters no host eviction may take: used by a request in flight, or held by a GPU copy
        that is referenced (a running sequence, or cached mode's permanent reference)."""
        return self.requests.adapters_in_use() | self.engines.referenced_on_gpu()

    def never_fits(self, entry: AdapterEntry) -> bool:
        """Larger than the whole host store: no eviction can ever make room for it."""
        return self.tier is not None and entry.store_bytes > self.tier.capacity

    def too_large_message(self, entry: AdapterEntry) -> str:
        return (f"adapter {entry.name!r} needs {entry.store_bytes} bytes in the host store, which holds "
                f"{self.tier.capacity} bytes in all (model.host_store_bytes); it can never be served")

    # ---- loads and evictions (the caller holds the lock) -------------------------------------
    async def admit(self, entry: AdapterEntry, *, evict: bool, recovering: bool = False) -> bool:
        """Bring `entry` into the host store. True: host-resident (its store_entry set); False:
        valid but kept on disk, no room. EngineRefused: bad files."""
        tier = self.tier
        if tier.is_resident(entry.name) and entry.store_entry is not None:
            return True
        while True:
            started = time.perf_counter()
            try:
                reply = await self.call(EngineLoadAdapter(name=entry.name, path=entry.path), recovering=recovering)
            except EngineRefused:
                tier.failures += 1
                raise
            if isinstance(reply, EngineAdapterLoaded) and reply.store_entry is not None:
                entry.loaded(reply)
                entry.store_bytes = ArenaAllocator.extent_size(reply.store_entry.nbytes)
                tier.add(entry.name, entry.store_bytes, (time.perf_counter() - started) * 1e3)
                return True
            entry.loaded(reply)  # cache_store_full: the files are valid, the store has no room
            entry.store_bytes = reply.needed_bytes
            if self.never_fits(entry):
                return False
            victims = tier.victims(reply.needed_bytes, reply.free_bytes, self.busy_adapters()) if evict else []
            if not victims:
                return False
            for name in victims:
                await self.evict(name, recovering=recovering)

    async def evict(self, name: str, *, evicted: bool = True, recovering: bool = False) -> None:
        """Take `name` out of the host tier: engines drop their host and GPU copies first, then
        the store frees its extent."""
        await self.engines.drop(name)
        entry = self.adapters.get(name)
        if entry is not None:
            entry.store_entry = None
        if self.tier.remove(name, evicted=evicted) or not evicted:
            await self.call(EngineUnloadAdapter(name=name), recovering=recovering)
        log.info("host tier: %s %s", "evicted" if evicted else "dropped", name)

    # ---- admin orders ------------------------------------------------------------------------
    async def add(self, entry: AdapterEntry) -> None:
        """A new adapter: host store (evicting idle ones), then every engine; on disk if it cannot
        fit. Rejected, with nothing left behind, for bad files or one that can never fit."""
        if entry.pinned:
            self.tier.pin(entry.name)
        code = ErrorCode.INVALID_ADAPTER
        try:
            async with self.lock:
                if await self.admit(entry, evict=True):
                    await self.engines.load(entry, keep_resident=True)
        except EngineRefused as exc:
            entry.failed(str(exc))
            code = ErrorCode(exc.code) if exc.code == ErrorCode.FORBIDDEN_PATH.value else code
        if entry.state == "ready" and self.never_fits(entry):
            entry.failed(self.too_large_message(entry))
            code = ErrorCode.TOO_LARGE
        if entry.state != "ready":
            self.tier.unpin(entry.name)
            await self.engines.unload(entry.name)
            await self.forget(entry.name)
            raise Rejected(code, entry.error or "the adapter was refused")

    async def reload(self, entry: AdapterEntry) -> None:
        """New files under an existing name (no request uses it): every old copy goes, then
        the new content is registered (on disk if it cannot fit). Failures mark the entry."""
        async with self.lock:
            await self.evict(entry.name, evicted=False)
            try:
                if await self.admit(entry, evict=True):
                    await self.engines.load(entry, keep_resident=False)
            except EngineRefused as exc:
                entry.failed(str(exc))

    async def validate(self, name: str, path: str) -> None:
        """Have the cache manager check files under a scratch name; EngineRefused if bad."""
        async with self.lock:
            reply = await self.call(EngineLoadAdapter(name=name, path=path))
            if isinstance(reply, EngineAdapterLoaded):
                await self.call(EngineUnloadAdapter(name=name))

    async def forget(self, name: str) -> None:
        async with self.lock:
            if self.tier.remove(name):
                await self.call(EngineUnloadAdapter(name=name))

    def snapshot(self) -> dict[str, object] | None:
        if self.tier is None:
            return None
        return {**self.tier.snapshot(), "pid": self.link.pid, "alive": self.link.alive(),
                "starts": self.link.starts, "segment": self.link.segment, "spare_pid": self.link.spare_pid,
                "spare_ready": self.link.spare_ready}
