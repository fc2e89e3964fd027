"""The engine replicas behind one router: their bring-up, their restart after a loss (with the
requests they held re-placed and recomputed), request migration between them, what every
engine does with an adapter at once, and cpu_assist's CPU worker driver.

Torch-free. A moved or recomputed request continues from its prompt and the tokens already
streamed: no gap, no duplicate.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from collections.abc import Sequence as SequenceOf

from loraplex.contracts.engine_spec import LoadMode
from loraplex.daemon.adapter_table import AdapterEntry, AdapterTable
from loraplex.daemon.child_link import EngineDied, EngineRefused
from loraplex.daemon.config import LoraplexConfig
from loraplex.daemon.controls import Controls
from loraplex.daemon.engine_link import EngineLink
from loraplex.daemon.engine_slot import EngineSlot
from loraplex.daemon.rejected import Rejected
from loraplex.daemon.replicas import Replicas, build_router
from loraplex.daemon.request_table import RequestTable
from loraplex.daemon.scheduler.sequence import SeqRequest, Sequence
from loraplex.daemon.stats import ServingStats
from loraplex.ipc.errors import ErrorCode
from loraplex.ipc.protocol import EngineFailure, EngineHello

log = logging.getLogger("loraplex.daemon")
MAX_ENGINE_RETRIES = 2  # recomputes of one request after engine losses before it fails
MAX_RESTART_DELAY_S = 30.0


class EngineSupervisor:
    def __init__(self, config: LoraplexConfig, links: SequenceOf[EngineLink], adapters: AdapterTable,
                 requests: RequestTable, stats: ServingStats, controls: Controls,
                 make_cpu_pool: Callable[[], object] | None = None) -> None:
        self.config = config
        self.slots = [EngineSlot(i, link, config) for i, link in enumerate(links)]
        self.replicas = Replicas(self.slots, build_router(controls.router, config.scheduler),
                                 config.scheduler.rebalance_interval_s)
        self.adapters = adapters
        self.requests = requests
        self.stats = stats
        self.controls = controls
        self._make_cpu_pool = make_cpu_pool
        self.cpu = None  # CpuAssistDriver in cpu_assist mode (one engine)
        self.hello: EngineHello | None = None  # the first engine's: what model every engine runs
        self.load_mode: str = LoadMode.ON_DEMAND.value  # as the engines resolved model.adapter_load_mode

    def alive(self) -> bool:
        """At least one engine process is running (the watchdog's health check)."""
        return any(slot.link.alive() for slot in self.slots)

    def schedulers(self) -> list:
        return [slot.scheduler for slot in self.slots if slot.scheduler is not None]

    # ---- bring-up ----------------------------------------------------------------------------
    async def start(self) -> None:
        """Start every engine, concurrently; if one cannot start, stop them all and raise why
        (EngineDied, EngineRefused)."""
        results = await asyncio.gather(*(self.bring_up(slot) for slot in self.slots), return_exceptions=True)
        failure = next((r for r in results if isinstance(r, BaseException)), None)
        if failure is not None:
            for slot in self.slots:
                await slot.link.stop()
            raise failure

    async def bring_up(self, slot: EngineSlot) -> None:
        hello = await slot.bring_up(self.adapters, self.controls.policy, self.controls.cache_policy,
                                    self.config.model.load_groups)
        self.hello = self.hello or hello
        # A PCIe figure only with a GPU: on the CPU the engine's link rate is a memcpy (cpu_assist plans with it).
        self.stats.link_bytes_per_s = hello.link_bytes_per_s if hello.device.startswith("cuda") else None
        self.load_mode = hello.load_mode
        if self.load_mode == LoadMode.CPU_ASSIST:
            await self._start_cpu_assist(hello)
        if self.load_mode == LoadMode.CACHED:
            await slot.preload(self.adapters)
        slot.release_waiting()

    async def _start_cpu_assist(self, hello: EngineHello) -> None:
        if self.cpu is not None:
            self.cpu.set_engine(hello)
            return
        if self._make_cpu_pool is None:
            raise EngineRefused(EngineFailure(code=ErrorCode.INTERNAL.value, message="cpu_assist needs a worker pool"))
        from loraplex.cpu_lora.calibration import load_or_calibrate
        from loraplex.daemon.cpu_assist_driver import CpuAssistDriver

        pool = self._make_cpu_pool()
        await pool.start()
        profile = await load_or_calibrate(pool, hello.hidden_size)
        self.cpu = CpuAssistDriver(pool, hello, profile, self.config.model.load_groups)
        log.info("cpu_assist: %d CPU LoRA workers, %.0f MB/s link", pool.size, hello.link_bytes_per_s / 1e6)

    def attach_store(self, segment: str) -> None:
        """The cache manager's host store (a new one after each of its restarts): engines take
        adapters from it, and an engine that starts attaches it instead of making its own."""
        for slot in self.slots:
            slot.attach_store(segment)
        if self.cpu is not None:
            self.cpu.store = segment

    async def stop(self) -> None:
        for slot in self.slots:
            await slot.link.stop()
        if self.cpu is not None:
            await self.cpu.pool.stop()

    # ---- requests ----------------------------------------------------------------------------
    def place(self, seq: SeqRequest) -> EngineSlot:
        """Queue a new request on the engine the router picks. CapacityError: it can never fit."""
        slot = self.replicas.choose(seq, self.adapters)
        slot.enqueue(seq)
        state = self.requests.get(seq.request_id)
        if state is not None:
            state.engine = slot.index
        return slot

    def forget(self, key: str) -> None:
        for slot in self.slots:
            slot.forget(key)

    def migrate(self, key: str, target: int) -> None:
        """Move request `key` (queued or running) to engine `target` between two of its engine's
        steps; a running one continues there by recompute from its prompt and streamed tokens."""
        state = self.requests.get(key)
        if state is None or not 0 <= target < len(self.slots):
            raise Rejected(ErrorCode.NOT_FOUND, f"no request {key!r} in flight, or no engine {target}")
        source = self.slots[state.engine]
        source.moves.append((key, target))
        source.work.set()

    def carry_out_moves(self, slot: EngineSlot) -> None:
        moves, slot.moves = slot.moves, []
        for key, target in moves:
            if self.replicas.migrate(key, slot.index, target) is not None:
                self._moved(key, target)

    def rebalance(self) -> None:
        """Carry out the router's request-adapter co-migrations (dlora); each moved request is
        recomputed on its new engine from its prompt and the tokens already streamed."""
        for migration, seqs in self.replicas.rebalance(self.adapters):
            for seq in seqs:
                self._moved(seq.request_id, migration.target)

    def _moved(self, key: str, target: int) -> None:
        state = self.requests.get(key)
        if state is not None:
            state.engine = target
            state.migrations += 1

    # ---- loss --------------------------------------------------------------------------------
    async def engine_lost(self, slot: EngineSlot, reason: str) -> None:
        """Restart a dead engine. Its requests go to another healthy engine at once, or wait for
        this one; either way they are recomputed from their prompt and the tokens already
        streamed (up to MAX_ENGINE_RETRIES times each), so nothing is lost or repeated."""
        log.error("engine %d lost: %s", slot.index, reason)
        self.stats.engine_restarts += 1
        seqs, pending = slot.take_all()
        for seq in seqs:
            await self._recompute_elsewhere(slot, seq, reason)
        for req in pending:
            target = self.replicas.choose(req, self.adapters, exclude=slot.index)
            if req.request_id in self.requests:
                self.requests[req.request_id].engine = target.index
            target.enqueue(req)
            self.replicas.rerouted += target is not slot
        await self._restart(slot)

    async def _recompute_elsewhere(self, lost: EngineSlot, seq: Sequence, reason: str) -> None:
        state = self.requests.get(seq.request_id)
        if state is None:
            return
        state.engine_retries += 1
        if state.engine_retries > MAX_ENGINE_RETRIES:
            await self.requests.fail(seq.request_id, ErrorCode.ENGINE_FAILED,
                                     f"the engine failed {state.engine_retries} times while running this request "
                                     f"({reason})")
            return
        target = self.replicas.choose(seq, self.adapters, exclude=lost.index)
        state.engine = target.index
        target.adopt_sequence(seq)
        self.replicas.rerouted += target is not lost

    async def _restart(self, slot: EngineSlot) -> None:
        """Bring the engine up again, backing off; what waits for it fails while it cannot start."""
        delay = 0.5
        while True:
            try:
                await self.bring_up(slot)
                log.info("engine %d restarted", slot.index)
                return
            except (EngineDied, EngineRefused, OSError) as exc:
                log.error("engine %d restart failed: %s; retrying in %.1f s", slot.index, exc, delay)
                waiting = [s.request_id for s in slot.carried] + [r.request_id for r in slot.pending]
                slot.carried, slot.pending = [], []
                for key in waiting:
                    await self.requests.fail(key, ErrorCode.UNAVAILABLE, f"the engine could not be restarted: {exc}")
                await asyncio.sleep(delay)
                delay = min(delay * 2, MAX_RESTART_DELAY_S)

    # ---- what every engine does with an adapter ---------------------------------------------
    def set_policy(self, name: str) -> None:
        for slot in self.slots:
            slot.policy_switch = name
            slot.work.set()

    def set_cache_policy(self, name: str) -> None:
        for sched in self.schedulers():
            sched.adapters.set_policy(name)

    def pin(self, name: str, pinned: bool) -> None:
        for sched in self.schedulers():
            (sched.adapters.pin if pinned else sched.adapters.unpin)(name)

    def keep_for_cached_mode(self, entry: AdapterEntry, *, in_store: bool = True) -> None:
        """cached mode: a ready adapter (in the host store, with one) is placed on every engine with
        the next step and kept for good."""
        if self.load_mode == LoadMode.CACHED and entry.state == "ready" and in_store:
            for sched in self.schedulers():
                sched.adapters.acquire(entry.name, entry.num_pages)

    async def load(self, entry: AdapterEntry, *, keep_resident: bool) -> None:
        """Every running engine takes the adapter from the host store; keep_resident: the same content
        as an engine's copy, whose GPU pages stay. An engine lost meanwhile (before or during its
        load) is skipped: its restart loads every adapter the store holds (EngineSlot.bring_up),
        and the requests for it wait for that, never failing for it."""
        for slot in self.slots:
            if slot.link.alive() and slot.hello is not None:
                try:
                    await slot.load_adapter(entry, keep_resident=keep_resident)
                except EngineDied as exc:
                    log.warning("engine %d lost while loading %s (%s); it loads it when it is back",
                                slot.index, entry.name, exc)

    async def unload(self, name: str) -> None:
        for slot in self.slots:
            await slot.unload_adapter(name)

    async def drop(self, name: str) -> None:
        """Host-tier eviction: every engine drops its host and (unreferenced) GPU copy."""
        for slot in self.slots:
            await slot.drop_adapter(name)

    def on_gpu(self, name: str) -> bool:
        return any(sched.adapters.is_resident(name) for sched in self.schedulers())

    def referenced_on_gpu(self) -> set[str]:
        """Adapters whose GPU copy is referenced (a running sequence, or cached mode's reference)."""
        busy: set[str] = set()
        for sched in self.schedulers():
            busy.update(n for n in sched.adapters.resident_names() if sched.adapters.refs(n))
        return busy

    def describe(self) -> list[dict[str, object]]:
        return [slot.describe() for slot in self.slots]
