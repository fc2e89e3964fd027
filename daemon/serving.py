"""The serving core: admits client requests, routes them to engine replicas, runs one
iteration loop per engine (schedule -> engine step -> stream tokens), and survives engine
and cache-manager deaths.

It owns its collaborators and wires them together; each has one concern and a small
interface: the requests in flight (RequestTable), admission (RequestAdmission), the engine
replicas (EngineSupervisor), adapter administration (AdapterAdmin, with the requests held
for an adapter), the host tier (HostTierService, HostLoader) and one StepLoop per engine.
See docs/architecture.md, 'The serving core'.

Torch-free and socket-free: replies go out through the `send` callback the server gives it,
so tests can drive it with a fake transport. Engines are executors behind EngineLink; every
policy decision is made here.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable
from typing import Callable
from typing import Sequence as SequenceOf

from loraplex.contracts.engine_spec import LoadMode
from loraplex.daemon.adapter_admin import AdapterAdmin
from loraplex.daemon.adapter_hash import AdapterReader
from loraplex.daemon.adapter_identity import AdapterIdentity
from loraplex.daemon.adapter_table import AdapterEntry, AdapterTable
from loraplex.daemon.cache_link import CacheManagerLink
from loraplex.daemon.config import LoraplexConfig
from loraplex.daemon.controls import Controls
from loraplex.daemon.decision_log import DecisionLog
from loraplex.daemon.engine_link import EngineLink
from loraplex.daemon.engine_supervisor import EngineSupervisor
from loraplex.daemon.gpu_cache.policies import POLICY_NAMES
from loraplex.daemon.grammar_gate import GrammarGate
from loraplex.daemon.grammar_link import GrammarWorkerLink
from loraplex.daemon.held_requests import HeldRequests
from loraplex.daemon.host_loads import HostLoader
from loraplex.daemon.host_service import HostTierService
from loraplex.daemon.rejected import Rejected
from loraplex.daemon.replicas import build_router
from loraplex.daemon.request_admission import RequestAdmission
from loraplex.daemon.request_table import RequestTable, Send
from loraplex.daemon.router import ROUTERS
from loraplex.daemon.scheduler.factory import POLICIES
from loraplex.daemon.stats import ServingStats, in_flight_rows, queue_rows
from loraplex.daemon.step_loop import StepLoop
from loraplex.ipc.adapter_files import resolve_roots
from loraplex.ipc.errors import ErrorCode
from loraplex.ipc.protocol import EngineHello, GenerateRequest

log = logging.getLogger("loraplex.daemon")


class ServingCore:
    def __init__(self, config: LoraplexConfig, engines: EngineLink | SequenceOf[EngineLink], send: Send,
                 make_cpu_pool: Callable[[], object] | None = None, cache: CacheManagerLink | None = None,
                 make_grammar_worker: Callable[[int], GrammarWorkerLink] | None = None) -> None:
        self.config = config
        sched = config.scheduler
        self.controls = Controls(policy=sched.policy, cache_policy=sched.cache_policy, router=sched.router)
        self.stats = ServingStats()
        self.adapters = AdapterTable()
        self.requests = RequestTable(send, self.stats)
        links = list(engines) if isinstance(engines, (list, tuple)) else [engines]
        self.engines = EngineSupervisor(config, links, self.adapters, self.requests, self.stats, self.controls,
                                        make_cpu_pool)
        self.held = HeldRequests(self.requests, self.engines.place)
        self.requests.on_forget = self._forget
        # Adapter files are read (hashed) off the loop with a deadline; admin orders run concurrently.
        self.reader = AdapterReader(resolve_roots(config.server.adapter_dirs), config.server.adapter_read_timeout_s)
        self.identity = AdapterIdentity(self.reader)
        # The host tier: the cache manager process owns the host store; None: each engine reads
        # adapters from disk into its own memory.
        self.host = self.loader = None
        if cache is not None:
            self.host = HostTierService(cache, self.adapters, self.engines, self.requests, self.reader)
            self.loader = HostLoader(self.host, self.engines, self.adapters, self.requests, self.held,
                                     self.identity, self.controls)
            for slot in self.engines.slots:
                slot.host_resident = self.host.is_resident
        self.adapter_admin = AdapterAdmin(self.adapters, self.engines, self.requests, self.held, self.identity,
                                          self.host, self.loader)
        # Structured output: each new grammar is compiled within the limits by a worker process before
        # its request is queued (None: the engines compile alone, as with a stub engine in tests).
        self.grammars = GrammarGate(config.server, make_grammar_worker) if make_grammar_worker is not None else None
        self.admission = RequestAdmission(config.server, self.requests, self.adapters, self.engines, self.held,
                                          self.stats, self.controls, self.host, self.loader, self.grammars)
        self.decisions: DecisionLog | None = None  # server.decision_log, opened by start()
        self._loops: list[asyncio.Task] = []

    def _forget(self, key: str) -> None:
        """A request left: it waits nowhere any more."""
        self.engines.forget(key)
        self.held.drop(key)

    @property
    def hello(self) -> EngineHello | None:
        return self.engines.hello

    def engines_alive(self) -> bool:
        return self.engines.alive()

    # ---- lifecycle --------------------------------------------------------------------------
    async def start(self, adapters: Iterable[AdapterEntry]) -> None:
        """Start the engines (concurrently), register `adapters`, start stepping. Raises EngineDied /
        EngineRefused if an engine cannot start. With a host tier no adapter file is read here (but in
        cached mode), so start-up never waits on one: each is validated and loaded when a request
        first needs it, and the host store is warmed in the background (most used first) once serving."""
        for entry in adapters:
            self.adapters.put(entry)
        if self.config.server.decision_log:
            self.decisions = DecisionLog(self.config.server.decision_log)
        if self.host is not None:  # before the engines: they attach its store
            await self.host.start()
            for entry in self.adapters.entries():
                if entry.pinned:
                    self.host.pin(entry.name, True)
        try:
            await self.engines.start()
        except BaseException:
            if self.host is not None:
                await self.host.stop()
            raise
        self.admission.use_model(self.engines.hello)
        if self.loader is not None and self.engines.load_mode == LoadMode.CACHED:
            # cached mode places every adapter at start by definition: its start-up grows with them
            # (each read still bounded by server.adapter_read_timeout_s; a bad one is marked `error`).
            await self.loader.warm()
            for slot in self.engines.slots:
                if slot.scheduler is not None:
                    await slot.flush_placements()
        self._loops = [asyncio.create_task(self._loop(slot).run(), name=f"step-loop-{slot.index}")
                       for slot in self.engines.slots]
        if self.loader is not None and self.engines.load_mode != LoadMode.CACHED:
            self.loader.start_warming()

    def _loop(self, slot) -> StepLoop:
        return StepLoop(slot, self.engines, self.requests, self.adapters, self.stats, self.controls, self.decisions)

    async def stop(self) -> None:
        if self.loader is not None:
            await self.loader.stop_warming()
        for task in self._loops:
            task.cancel()
        await asyncio.gather(*self._loops, return_exceptions=True)
        for key in list(self.requests):
            await self.requests.fail(key, ErrorCode.SHUTTING_DOWN, "the daemon is shutting down")
        await self.engines.stop()
        if self.grammars is not None:
            await self.grammars.stop()
        if self.host is not None:  # last: engines may read its store until they exit
            await self.loader.cancel_loads()
            await self.host.stop()
        if self.decisions is not None:
            self.decisions.close()
        self.admission.intake.close()

    async def drain(self, timeout_s: float) -> bool:
        """Stop admitting; wait up to `timeout_s` for in-flight requests. True if all finished.
        A paused daemon resumes: what it holds must run to finish."""
        self.controls.draining = True
        if self.controls.paused:
            self.set_paused(False)
        try:
            await asyncio.wait_for(self.requests.idle.wait(), timeout_s)
            return True
        except asyncio.TimeoutError:
            return False

    # ---- client orders ------------------------------------------------------------------------
    async def submit(self, identity: bytes, msg: GenerateRequest) -> None:
        await self.admission.submit(identity, msg)

    async def tokenize(self, identity: bytes, text: str) -> list[int]:
        """`text`'s token ids, bounded and computed as prompts are (the client's turn, its byte budget)."""
        intake = self.admission.intake
        if intake.tokenizer is not None and not text:
            return []
        intake.check_text(text)
        return await intake.encode(identity, text)

    async def detokenize(self, ids: list[int]) -> str:
        return await self.admission.intake.decode(ids)

    @property
    def max_model_len(self) -> int:
        return self.admission.intake.max_model_len

    async def cancel(self, identity: bytes, request_id: str) -> bool:
        return await self.requests.cancel(identity, request_id)

    async def client_gone(self, identity: bytes) -> None:
        await self.requests.client_gone(identity)

    # ---- admin orders -------------------------------------------------------------------------
    async def add_adapter(self, name: str, path: str, pinned: bool = False) -> AdapterEntry:
        return await self.adapter_admin.add(name, path, pinned)

    async def replace_adapter(self, name: str, path: str) -> tuple[AdapterEntry, bool]:
        return await self.adapter_admin.replace(name, path)

    def check_removable(self, name: str) -> None:
        self.adapter_admin.check_removable(name)

    async def remove_adapter(self, name: str) -> None:
        await self.adapter_admin.remove(name)

    def pin_adapter(self, name: str, pinned: bool) -> None:
        self.adapter_admin.pin(name, pinned)

    def adapter_list(self) -> list[dict[str, object]]:
        return self.adapter_admin.listing()

    async def fits_model(self, name: str, path: str) -> bool:
        return await self.adapter_admin.fits_model(name, path)

    async def files_changed(self, name: str, path: str) -> bool:
        return await self.adapter_admin.files_changed(name, path)

    def migrate(self, key: str, target: int) -> None:
        self.engines.migrate(key, target)

    def set_policy(self, name: str) -> None:
        """Switch the scheduling policy at run time; takes effect before each engine's next step."""
        if name not in POLICIES:
            raise Rejected(ErrorCode.INVALID_FIELD, f"unknown scheduler {name!r}; choose one of {POLICIES}")
        self.controls.policy = name
        self.engines.set_policy(name)

    def set_cache_policy(self, name: str) -> None:
        """Switch the GPU adapter cache policy at run time; resident adapters stay."""
        if name not in POLICY_NAMES:
            raise Rejected(ErrorCode.INVALID_FIELD, f"unknown cache policy {name!r}; choose one of {POLICY_NAMES}")
        self.controls.cache_policy = name
        self.engines.set_cache_policy(name)

    def set_router(self, name: str) -> None:
        """Switch the engine router at run time; requests already placed stay where they are."""
        if name not in ROUTERS:
            raise Rejected(ErrorCode.INVALID_FIELD, f"unknown router {name!r}; choose one of {', '.join(ROUTERS)}")
        try:
            self.engines.replicas.router = build_router(name, self.config.scheduler)
        except (OSError, ValueError) as exc:  # rank_aware's profile file
            raise Rejected(ErrorCode.INVALID_FIELD, f"router {name!r} cannot start: {exc}") from None
        self.controls.router = name

    def set_paused(self, paused: bool) -> None:
        """Hold or resume scheduling on every engine. Held, requests are still accepted, routed
        and queued, steps in flight finish, and an engine that dies is still replaced."""
        self.controls.paused = paused
        log.info("scheduling %s", "paused" if paused else "resumed")
        if not paused:
            for slot in self.engines.slots:
                slot.work.set()

    # ---- stats --------------------------------------------------------------------------------
    def snapshot(self) -> dict[str, object]:
        engines, controls = self.engines, self.controls
        scheds = engines.schedulers()
        first = engines.slots[0].scheduler
        cpu = engines.cpu
        return self.stats.snapshot(
            running=sum(len(s.running) for s in scheds),
            waiting=sum(len(s.waiting) for s in scheds) + sum(len(s.pending) + len(s.carried) for s in engines.slots),
            pool=self._pool(),
            prefix_cache=self._prefix_cache(),
            resident_adapters=sorted({n for s in scheds for n in s.adapters.resident_names()}),
            cache=first.adapters.snapshot(rank_of=self.adapters.rank_of) if first is not None else None,
            engine=engines.slots[0].link.describe(),
            engines=engines.describe(),
            router=controls.router,
            migrations=engines.replicas.migrated,
            rerouted=engines.replicas.rerouted,
            load_mode=engines.load_mode,
            cpu_assist=cpu.snapshot() if cpu is not None else None,
            workers=cpu.workers() if cpu is not None else [],
            draining=controls.draining,
            paused=controls.paused,
            preemptions=sum(s.num_preemptions for s in scheds),
            scheduler=controls.policy,
            queues=queue_rows(engines.slots),
            cache_policy=controls.cache_policy,  # also before an engine is up (cache.policy needs one)
            running_adapters=sorted({q.req.adapter for s in scheds for q in s.running if q.req.adapter}),
            waiting_adapters=sorted({q.req.adapter for s in scheds for q in s.waiting if q.req.adapter}),
            merged_adapter=first.merged_adapter if first is not None else None,
            max_loras_per_batch=self.config.scheduler.max_loras_per_batch,
            host_tier=self.host.snapshot() if self.host is not None else None,
            tokenizing=len(self.requests.tokenizing),
            in_flight=in_flight_rows(self.requests.values(), scheds, time.monotonic()),
            in_flight_total=len(self.requests),
            adapter_counts=self.adapter_admin.summary(),
            grammars=self.grammars.snapshot() if self.grammars is not None else None,
        )

    def _pool(self) -> dict[str, int] | None:
        """Pages of every engine's pool: free, KV held by sequences, cached prefixes nobody holds
        (the pool takes them back when it needs room), adapters."""
        slots = [s for s in self.engines.slots if s.allocator is not None]
        if not slots:
            return None
        usages = [s.allocator.usage() for s in slots]
        idle_prefix = sum(s.scheduler.prefix.idle_pages for s in slots
                          if s.scheduler is not None and s.scheduler.prefix is not None)
        return {"total": sum(u.total for u in usages), "free": sum(u.free for u in usages),
                "kv": sum(u.by_tag.get("kv", 0) for u in usages) - idle_prefix,
                "prefix_cache": idle_prefix,
                "adapter": sum(u.by_tag.get("adapter", 0) for u in usages)}

    def _prefix_cache(self) -> dict[str, object] | None:
        """The prefix cache over every engine: tokens looked up and found, pages, evictions."""
        caches = [s.scheduler.prefix for s in self.engines.slots
                  if s.scheduler is not None and s.scheduler.prefix is not None]
        if not caches:
            return None
        total: dict[str, int] = {}
        for cache in caches:
            for key, value in cache.snapshot().items():
                if key != "hit_rate":
                    total[key] = total.get(key, 0) + int(value)
        query = total.get("query_tokens", 0)
        return {**total, "hit_rate": round(total.get("hit_tokens", 0) / query, 4) if query else 0.0}
