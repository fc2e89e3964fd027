"""The serving core's host tier: drives the cache manager process (disk -> host
store), evicts host-tier victims when the store is full, holds requests whose
adapter is still on disk until it is loaded, and restarts a dead cache manager.

Torch-free; mixed into ServingCore (daemon/serving.py). Every load is awaited
over the cache manager's socket, so the event loop never blocks on disk.
One host-tier change runs at a time (`_host_lock`). Engines always drop an
adapter before the store frees it, so no engine ever reads a freed extent.
"""
from __future__ import annotations

import asyncio
import logging
import time

from loraplex.daemon.adapter_table import AdapterEntry
from loraplex.daemon.child_link import EngineDied, EngineRefused
from loraplex.daemon.host_tier import HostTier
from loraplex.daemon.serving_adapters import Rejected
from loraplex.ipc.adapter_files import allow_also
from loraplex.ipc.adapter_store import ArenaAllocator
from loraplex.ipc.errors import ErrorCode
from loraplex.ipc.protocol import EngineAdapterLoaded, EngineLoadAdapter, EngineUnloadAdapter, Message

log = logging.getLogger("loraplex.daemon.host")
MAX_RESTART_DELAY_S = 30.0
ROOM_RECHECK_S = 2.0  # a request held for host room retries at least this often


class HostTierAdmin:
    """Needs from its host class: cache, host_tier, adapters, slots, requests, cpu, _held,
    _departed, _host_lock, _host_loads, _release_held, _fail."""

    # ---- the cache manager process ---------------------------------------------------------
    async def _cache_up(self) -> None:
        """Start the cache manager (before any engine); its store becomes the engines' store."""
        hello = await self.cache.start()
        if self.host_tier is None:
            self.host_tier = HostTier(hello.capacity_bytes)
        self.host_tier.capacity = hello.capacity_bytes
        for slot in self.slots:
            slot.store_segment = hello.store_segment
            slot.link.spec = {**slot.link.spec, "host_store_segment": hello.store_segment}
        if self.cpu is not None:
            self.cpu.store = hello.store_segment
        for name, path in hello.demo_adapters.items():  # the built-in demo's adapters, serving without --model
            if name not in self.adapters:
                self.adapters.put(AdapterEntry(name=name, path=path))
        self.reader.roots = allow_also(self.reader.roots, hello.demo_adapters.values())
        self.cache.on_lost = self._on_cache_lost
        log.info("cache manager up (pid %s): host store %s, %.1f MB", self.cache.pid, hello.store_segment,
                 hello.capacity_bytes / 1e6)

    async def _stop_cache(self) -> None:
        self.cache.on_lost = None
        tasks = [t for t in (*self._host_loads.values(), self._cache_recovery) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.cache.stop()

    def _on_cache_lost(self) -> None:
        if self._cache_recovery is None or self._cache_recovery.done():
            self._cache_recovery = asyncio.ensure_future(self._recover_if_dead())

    async def _recover_if_dead(self) -> None:
        async with self._host_lock:
            if not self.cache.alive():
                await self._recover_cache(self.cache.lost_reason or "the cache manager exited")

    async def _recover_cache(self, reason: str) -> None:
        """Restart a dead cache manager (caller holds _host_lock). Its store is gone, but engines
        still map it, so what they hold keeps serving; the adapters in use (then the most
        recent) are reloaded into the new store and engines rebind to it, keeping their GPU
        copies. What does not fit leaves the engines unless a request in flight uses it."""
        log.error("cache manager lost: %s; restarting it", reason)
        previous = self.host_tier.resident_names()  # least recently used first
        self.host_tier.reset()
        for entry in self.adapters.entries():
            entry.store_entry = None
        delay = 0.5
        while True:
            try:
                await self._cache_up()
                break
            except (EngineDied, EngineRefused, OSError) as exc:
                log.error("cache manager restart failed: %s; retrying in %.1f s", exc, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, MAX_RESTART_DELAY_S)
        busy = self._busy_adapters()
        order = [n for n in reversed(previous) if n in busy] + [n for n in reversed(previous) if n not in busy]
        for name in order:
            entry = self.adapters.get(name)
            if entry is None:
                continue
            try:
                admitted = await self._host_admit(entry, evict=False, recovering=True)
            except (EngineDied, EngineRefused) as exc:
                log.warning("adapter %s not reloaded after the cache manager restart: %s", name, exc)
                admitted = False
            if admitted:
                await self._engines_load(entry, keep_resident=True)
            elif name not in self._busy_adapters():
                for slot in self.slots:
                    await slot.drop_adapter(name)
        log.info("cache manager restarted; %d adapters back in the host store", len(self.host_tier.resident_names()))

    async def _cache_call(self, order: Message, *, recovering: bool = False) -> Message:
        """One order to the cache manager (caller holds _host_lock); a dead one is restarted and
        the order retried once. EngineRefused: the cache manager refused it."""
        try:
            return await self.cache.call(order)
        except EngineDied as exc:
            if recovering:
                raise
            await self._recover_cache(str(exc))
        return await self.cache.call(order)

    # ---- loads and evictions ---------------------------------------------------------------
    def _busy_adapters(self) -> set[str]:
        """Adapters no host eviction may take: used by a request in flight, or held by a GPU copy
        that is referenced (a running sequence, or cached mode's permanent reference)."""
        busy = {state.msg.adapter for state in self.requests.values() if state.msg.adapter}
        for slot in self.slots:
            if slot.scheduler is not None:
                residency = slot.scheduler.adapters
                busy.update(n for n in residency.resident_names() if residency.refs(n))
        return busy

    async def _host_admit(self, entry: AdapterEntry, *, evict: bool, recovering: bool = False) -> bool:
        """Bring `entry` into the host store (caller holds _host_lock). True: host-resident (its
        store_entry set); False: valid but kept on disk, no room. EngineRefused: bad files."""
        tier = self.host_tier
        if tier.is_resident(entry.name) and entry.store_entry is not None:
            return True
        while True:
            started = time.perf_counter()
            try:
                reply = await self._cache_call(EngineLoadAdapter(name=entry.name, path=entry.path),
                                               recovering=recovering)
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
            if self._never_fits(entry):
                return False
            victims = tier.victims(reply.needed_bytes, reply.free_bytes, self._busy_adapters()) if evict else []
            if not victims:
                return False
            for name in victims:
                await self._host_evict(name, recovering=recovering)

    def _never_fits(self, entry: AdapterEntry) -> bool:
        """Larger than the whole host store: no eviction can ever make room for it."""
        return self.host_tier is not None and entry.store_bytes > self.host_tier.capacity

    def _too_large_message(self, entry: AdapterEntry) -> str:
        return (f"adapter {entry.name!r} needs {entry.store_bytes} bytes in the host store, which holds "
                f"{self.host_tier.capacity} bytes in all (model.host_store_bytes); it can never be served")

    async def _host_evict(self, name: str, *, evicted: bool = True, recovering: bool = False) -> None:
        """Take `name` out of the host tier: engines drop their host and GPU copies first, then
        the store frees its extent (caller holds _host_lock)."""
        for slot in self.slots:
            await slot.drop_adapter(name)
        entry = self.adapters.get(name)
        if entry is not None:
            entry.store_entry = None
        if self.host_tier.remove(name, evicted=evicted) or not evicted:
            await self._cache_call(EngineUnloadAdapter(name=name), recovering=recovering)
        log.info("host tier: %s %s", "evicted" if evicted else "dropped", name)

    async def _engines_load(self, entry: AdapterEntry, *, keep_resident: bool = True) -> None:
        """Every running engine takes the adapter from the store (zero-copy views)."""
        for slot in self.slots:
            if slot.link.alive() and slot.hello is not None:
                await slot.load_adapter(entry, keep_resident=keep_resident)

    async def _register_with_cache(self, entry: AdapterEntry) -> None:
        """A new adapter: host store (evicting idle ones), then every engine; on disk if it
        cannot fit. EngineRefused for bad files."""
        async with self._host_lock:
            if await self._host_admit(entry, evict=True):
                await self._engines_load(entry)

    async def _reload_in_cache(self, entry: AdapterEntry) -> None:
        """New files under an existing name (no request uses it): every old copy goes, then
        the new content is registered (on disk if it cannot fit). Failures mark the entry."""
        async with self._host_lock:
            await self._host_evict(entry.name, evicted=False)
            try:
                if await self._host_admit(entry, evict=True):
                    await self._engines_load(entry, keep_resident=False)
            except EngineRefused as exc:
                entry.failed(str(exc))

    async def _validate_in_cache(self, name: str, path: str) -> None:
        """Have the cache manager check files under a scratch name; EngineRefused if bad."""
        async with self._host_lock:
            reply = await self._cache_call(EngineLoadAdapter(name=name, path=path))
            if isinstance(reply, EngineAdapterLoaded):
                await self._cache_call(EngineUnloadAdapter(name=name))

    async def _forget_in_cache(self, name: str) -> None:
        async with self._host_lock:
            if self.host_tier.remove(name):
                await self._cache_call(EngineUnloadAdapter(name=name))

    # ---- requests for adapters on disk -----------------------------------------------------
    def _needs_host_load(self, name: str) -> bool:
        return self.host_tier is not None and not self.host_tier.is_resident(name)

    def _note_tier(self, name: str) -> None:
        """Count where a request found its adapter (GPU, host store or disk)."""
        if any(s.scheduler is not None and s.scheduler.adapters.is_resident(name) for s in self.slots):
            tier = "gpu"
        else:
            tier = "host" if self.host_tier.is_resident(name) else "disk"
        self.host_tier.record_hit(tier)
        self.host_tier.touch(name)

    def _hold_for_host(self, name: str, seq) -> None:
        self._held.setdefault(name, []).append(seq)
        if name not in self._host_loads:
            self._host_loads[name] = asyncio.create_task(self._bring_to_host(name), name=f"host-load-{name}")

    async def _bring_to_host(self, name: str) -> None:
        """Load `name` for the requests held for it, then route them. While adapters of requests
        in flight fill the store, retry whenever a request leaves; fail the held requests when
        the files are bad or the adapter can never fit (the entry is marked `error` then)."""
        try:
            while any(seq.request_id in self.requests for seq in self._held.get(name, [])):
                entry = self.adapters.get(name)
                if entry is None:
                    await self._fail_held(name, ErrorCode.UNKNOWN_ADAPTER, f"adapter {name!r} was removed")
                    return
                self._departed.clear()
                try:
                    await self._ensure_identified(entry)  # off the lock: a slow file holds up no other load
                except Rejected as exc:
                    entry.failed(exc.message)
                    await self._fail_held(name, ErrorCode(exc.code), f"adapter {name!r} cannot be loaded: "
                                                                     f"{exc.message}")
                    return
                try:
                    async with self._host_lock:
                        admitted = await self._host_admit(entry, evict=True)
                        if admitted:
                            await self._engines_load(entry)
                except EngineRefused as exc:
                    entry.failed(str(exc))  # listed as `error` with its reason; new requests are refused at once
                    code = ErrorCode.FORBIDDEN_PATH if exc.code == ErrorCode.FORBIDDEN_PATH.value \
                        else ErrorCode.INVALID_ADAPTER
                    await self._fail_held(name, code, f"adapter {name!r} cannot be loaded: {exc}")
                    return
                except EngineDied as exc:
                    await self._fail_held(name, ErrorCode.UNAVAILABLE, f"the cache manager is unavailable: {exc}")
                    return
                if entry.state != "ready":
                    await self._fail_held(name, ErrorCode.INVALID_ADAPTER, entry.error or "the engine refused it")
                    return
                if admitted:
                    self._release_held(name)
                    return
                if self._never_fits(entry):
                    entry.failed(self._too_large_message(entry))
                    await self._fail_held(name, ErrorCode.TOO_LARGE, entry.error)
                    return
                log.info("host store full of adapters in use; %s waits for a request to finish", name)
                try:  # bounded: another waiter's clear() may have swallowed the departure meant for us
                    await asyncio.wait_for(self._departed.wait(), ROOM_RECHECK_S)
                except asyncio.TimeoutError:
                    pass
        finally:
            self._host_loads.pop(name, None)

    async def _fail_held(self, name: str, code: ErrorCode, message: str) -> None:
        self.host_tier.failures += 1
        for seq in self._held.pop(name, []):
            await self._fail(seq.request_id, code, message)

    def _release_or_load(self, name: str) -> None:
        """After a replacement: route the held requests, or load the adapter for them first."""
        if self._needs_host_load(name) and self._held.get(name):
            if name not in self._host_loads:
                self._host_loads[name] = asyncio.create_task(self._bring_to_host(name), name=f"host-load-{name}")
        else:
            self._release_held(name)

    # ---- the background warm-up -------------------------------------------------------------
    def start_warming(self) -> None:
        """After start: fill the host store from disk in the background, pinned and most used first."""
        if self._warming is None or self._warming.done():
            self._warming = asyncio.create_task(self._warm_host_tier(), name="host-warm-up")

    async def stop_warming(self) -> None:
        if self._warming is not None:
            self._warming.cancel()
            await asyncio.gather(self._warming, return_exceptions=True)
            self._warming = None

    async def _warm_host_tier(self) -> None:
        """Validate and load registered adapters into the host store one at a time, never evicting:
        stop at the first that finds no room (the rest load when a request needs them). A bad one
        is marked `error` with its reason. Requests' own loads go first: each step takes the lock
        briefly and the files are hashed outside it."""
        order = sorted(self.adapters.entries(), key=lambda e: (not e.pinned, -(e.uses + e.requests), e.name))
        warmed = 0
        for entry in order:
            if self.draining or self.adapters.get(entry.name) is not entry or entry.state == "error" \
                    or entry.replacing or self.host_tier.is_resident(entry.name):
                continue
            try:
                await self._ensure_identified(entry)
            except Rejected as exc:
                entry.failed(exc.message)
                log.warning("adapter %s: %s", entry.name, exc.message)
                continue
            async with self._host_lock:
                if self.adapters.get(entry.name) is not entry or self.host_tier.is_resident(entry.name):
                    continue
                try:
                    admitted = await self._host_admit(entry, evict=False)
                except EngineRefused as exc:
                    entry.failed(str(exc))
                    log.warning("adapter %s cannot be served: %s", entry.name, exc)
                    continue
                except EngineDied:
                    return  # the cache manager's recovery reloads what was in use
                if admitted:
                    await self._engines_load(entry)
                    self._keep_if_cached_mode(entry)
                    warmed += 1
                elif self._never_fits(entry):
                    entry.failed(self._too_large_message(entry))
                else:
                    break
        log.info("host store warmed: %d adapters loaded in the background (%d resident)", warmed,
                 len(self.host_tier.resident_names()))

    def host_snapshot(self) -> dict[str, object] | None:
        if self.host_tier is None:
            return None
        return {**self.host_tier.snapshot(), "pid": self.cache.pid, "alive": self.cache.alive(),
                "starts": self.cache.starts, "segment": self.cache.segment, "spare_pid": self.cache.spare_pid,
                "spare_ready": self.cache.spare_ready}
