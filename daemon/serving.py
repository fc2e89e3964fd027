"""The serving core: admits client requests, routes them to engine replicas,
runs one iteration loop per engine (schedule → engine step → stream tokens),
and survives engine deaths.

Torch-free and socket-free: replies go out through the `send` callback the
server gives it, so tests can drive it with a fake transport. Engines are
executors behind EngineLink; every policy decision is made here.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable
from typing import Awaitable, Callable
from typing import Sequence as SequenceOf

from loraplex.daemon.adapter_hash import AdapterReader
from loraplex.daemon.adapter_table import AdapterEntry, AdapterTable
from loraplex.daemon.config import LoraplexConfig
from loraplex.daemon.decision_log import DecisionLog, StepDecision
from loraplex.daemon.detokenizer import load_tokenizer
from loraplex.daemon.child_link import EngineDied, EngineRefused
from loraplex.daemon.engine_link import EngineLink
from loraplex.daemon.engine_slot import EngineSlot
from loraplex.daemon.intake import PromptIntake
from loraplex.daemon.replicas import Replicas, build_router
from loraplex.daemon.serving_adapters import AdapterAdmin, Rejected
from loraplex.daemon.serving_engines import EngineEvents
from loraplex.daemon.serving_host import HostTierAdmin
from loraplex.daemon.serving_requests import RequestAdmission, request_key
from loraplex.daemon.router import ROUTERS
from loraplex.daemon.memory.allocator import PageAllocator
from loraplex.daemon.request_state import ClientRequest
from loraplex.daemon.gpu_cache.policies import POLICY_NAMES
from loraplex.daemon.scheduler.base import BaseScheduler
from loraplex.daemon.scheduler.factory import POLICIES
from loraplex.daemon.scheduler.sequence import Sequence, SeqRequest
from loraplex.daemon.stats import ServingStats, in_flight_rows
from loraplex.ipc.adapter_files import resolve_roots
from loraplex.ipc.engine_plan import StepPlan
from loraplex.ipc.errors import ErrorCode
from loraplex.ipc.protocol import (
    EngineFailure,
    EngineHello,
    EngineStep,
    EngineStepDone,
    ErrorReply,
    Message,
    TokenChunk,
)

log = logging.getLogger("loraplex.daemon")
Send = Callable[[bytes, Message], Awaitable[None]]
MAX_STEP_FAILURES = 3


class ServingCore(RequestAdmission, AdapterAdmin, HostTierAdmin, EngineEvents):
    def __init__(self, config: LoraplexConfig, engines: EngineLink | SequenceOf[EngineLink], send: Send,
                 make_cpu_pool: Callable[[], object] | None = None, cache: EngineLink | None = None) -> None:
        self.config = config
        links = list(engines) if isinstance(engines, (list, tuple)) else [engines]
        self.slots = [EngineSlot(i, link, config) for i, link in enumerate(links)]
        self.router_name = config.scheduler.router
        self.replicas = Replicas(self.slots, build_router(self.router_name, config.scheduler),
                                 config.scheduler.rebalance_interval_s)
        self.send = send
        self._make_cpu_pool = make_cpu_pool
        self.cpu = None  # CpuAssistDriver in cpu_assist mode (one engine)
        self.load_mode = "on_demand"
        self.policy = config.scheduler.policy
        self.cache_policy = config.scheduler.cache_policy
        self.adapters = AdapterTable()
        self.requests: dict[str, ClientRequest] = {}
        self.stats = ServingStats()
        self.hello: EngineHello | None = None
        self.tokenizer = None
        self.intake = self._make_intake(None, 0, 0)  # replaced once an engine said what it runs
        self._intake: dict[str, asyncio.Task] = {}  # request key -> its prompt being tokenized
        self.draining = False
        self.paused = False  # admin pause: requests queue up, no new step starts
        self.decisions: DecisionLog | None = None  # server.decision_log, opened by start()
        self._idle = asyncio.Event()
        self._idle.set()
        self._per_client: dict[bytes, int] = {}  # identity -> requests in flight
        self._deadlines: dict[str, asyncio.TimerHandle] = {}  # request key -> its deadline_ms timer
        self._held: dict[str, list[SeqRequest]] = {}  # adapter being replaced -> requests waiting for it
        self._departed = asyncio.Event()  # set whenever a request leaves
        # The host tier (daemon/serving_host.py): the cache manager process (a CacheManagerLink) owns
        # the host store; None: each engine reads adapters from disk into its own memory.
        self.cache = cache
        self.host_tier = None  # daemon.host_tier.HostTier once the cache manager is up
        if cache is not None:
            for slot in self.slots:
                slot.host_resident = self._in_host_store
        self._host_lock = asyncio.Lock()
        self._host_loads: dict[str, asyncio.Task] = {}  # adapter -> load for requests held for it
        self._cache_recovery: asyncio.Task | None = None
        self._warming: asyncio.Task | None = None  # the background warm-up of the host store
        # Adapter files are read (hashed) off the loop with a deadline; admin orders run concurrently.
        self.reader = AdapterReader(resolve_roots(config.server.adapter_dirs), config.server.adapter_read_timeout_s)
        self._adding: set[str] = set()  # names whose add is in progress
        # Told when an adapter's files were (re)hashed, so the registry keeps the identity (set by main).
        self.on_identified: Callable[[AdapterEntry], None] | None = None

    # The first engine, for callers that think of one engine (the watchdog, single-engine tests).
    @property
    def engine(self) -> EngineLink:
        return self.slots[0].link

    @property
    def scheduler(self):
        return self.slots[0].scheduler

    @property
    def allocator(self) -> PageAllocator | None:
        return self.slots[0].allocator

    def engines_alive(self) -> bool:
        """At least one engine process is running (the watchdog's health check)."""
        return any(slot.link.alive() for slot in self.slots)

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
        if self.cache is not None:  # before the engines: they attach its store
            await self._cache_up()
            for entry in self.adapters.entries():
                if entry.pinned:
                    self.host_tier.pin(entry.name)
        results = await asyncio.gather(*(self._engine_up(slot) for slot in self.slots), return_exceptions=True)
        failure = next((r for r in results if isinstance(r, BaseException)), None)
        if failure is not None:
            for slot in self.slots:
                await slot.link.stop()
            if self.cache is not None:
                await self._stop_cache()
            raise failure
        if self.cache is not None and self.load_mode == "cached":
            # cached mode places every adapter at start by definition: its start-up grows with them
            # (each read still bounded by server.adapter_read_timeout_s; a bad one is marked `error`).
            await self._warm_host_tier()
            for slot in self.slots:
                if slot.scheduler is not None:
                    await slot.flush_placements()
        for slot in self.slots:
            slot.loop_task = asyncio.create_task(self._step_loop(slot), name=f"step-loop-{slot.index}")
        if self.cache is not None and self.load_mode != "cached":
            self.start_warming()

    async def _engine_up(self, slot: EngineSlot) -> None:
        hello = await slot.bring_up(self.adapters, self.policy, self.cache_policy, self.config.model.load_groups)
        first = self.hello is None
        self.hello = self.hello or hello
        self.stats.link_bytes_per_s = hello.link_bytes_per_s
        if first:  # once: a restarted engine runs the same model, and the intake's budgets must persist
            self.tokenizer = load_tokenizer(hello.model_dir)
            self.intake = self._make_intake(self.tokenizer, hello.max_model_len, hello.vocab_size)
        self.load_mode = hello.load_mode
        if self.load_mode == "cpu_assist":
            await self._start_cpu_assist(hello)
        if self.load_mode == "cached":
            await slot.preload(self.adapters)
        slot.release_waiting()

    def _make_intake(self, tokenizer, max_model_len: int, vocab_size: int) -> PromptIntake:
        server = self.config.server
        return PromptIntake(tokenizer, max_model_len, vocab_size, threads=server.tokenizer_threads,
                            max_queued_bytes_per_client=server.max_queued_prompt_bytes_per_client)

    def set_policy(self, name: str) -> None:
        """Switch the scheduling policy at run time; takes effect before each engine's next step."""
        if name not in POLICIES:
            raise Rejected(ErrorCode.INVALID_FIELD, f"unknown scheduler {name!r}; choose one of {POLICIES}")
        self.policy = name
        for slot in self.slots:
            slot.policy_switch = name
            slot.work.set()

    def set_cache_policy(self, name: str) -> None:
        """Switch the GPU adapter cache policy at run time; resident adapters stay."""
        if name not in POLICY_NAMES:
            raise Rejected(ErrorCode.INVALID_FIELD, f"unknown cache policy {name!r}; choose one of {POLICY_NAMES}")
        self.cache_policy = name
        for slot in self.slots:
            if slot.scheduler is not None:
                slot.scheduler.adapters.set_policy(name)

    def _in_host_store(self, name: str) -> bool:
        return self.host_tier is not None and self.host_tier.is_resident(name)

    def set_paused(self, paused: bool) -> None:
        """Hold or resume scheduling on every engine. Held, requests are still accepted, routed
        and queued, steps in flight finish, and an engine that dies is still replaced."""
        self.paused = paused
        log.info("scheduling %s", "paused" if paused else "resumed")
        if not paused:
            for slot in self.slots:
                slot.work.set()

    def set_router(self, name: str) -> None:
        """Switch the engine router at run time; requests already placed stay where they are."""
        if name not in ROUTERS:
            raise Rejected(ErrorCode.INVALID_FIELD, f"unknown router {name!r}; choose one of {', '.join(ROUTERS)}")
        try:
            self.replicas.router = build_router(name, self.config.scheduler)
        except (OSError, ValueError) as exc:  # rank_aware's profile file
            raise Rejected(ErrorCode.INVALID_FIELD, f"router {name!r} cannot start: {exc}") from None
        self.router_name = name

    def pin_adapter(self, name: str, pinned: bool) -> None:
        if self.host_tier is not None:
            (self.host_tier.pin if pinned else self.host_tier.unpin)(name)
        for slot in self.slots:
            if slot.scheduler is not None:
                (slot.scheduler.adapters.pin if pinned else slot.scheduler.adapters.unpin)(name)

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

    async def stop(self) -> None:
        await self.stop_warming()
        for slot in self.slots:
            if slot.loop_task is not None:
                slot.loop_task.cancel()
                try:
                    await slot.loop_task
                except asyncio.CancelledError:
                    pass
        for key in list(self.requests):
            await self._fail(key, ErrorCode.SHUTTING_DOWN, "the daemon is shutting down")
        for slot in self.slots:
            await slot.link.stop()
        if self.cpu is not None:
            await self.cpu.pool.stop()
        if self.cache is not None:  # last: engines may read its store until they exit
            await self._stop_cache()
        if self.decisions is not None:
            self.decisions.close()
        self.intake.close()

    async def drain(self, timeout_s: float) -> bool:
        """Stop admitting; wait up to `timeout_s` for in-flight requests. True if all finished.
        A paused daemon resumes: what it holds must run to finish."""
        self.draining = True
        if self.paused:
            self.set_paused(False)
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
            return True
        except asyncio.TimeoutError:
            return False

    # ---- requests (admission: daemon/serving_requests.py) ------------------------------------
    async def cancel(self, identity: bytes, request_id: str) -> bool:
        key = request_key(identity, request_id)
        if key not in self.requests:
            return False
        await self._finish(key, "cancelled")
        return True

    async def client_gone(self, identity: bytes) -> None:
        prefix = identity.hex() + "/"
        for key in [k for k in self.requests if k.startswith(prefix)]:
            self._abort(key)
            self.requests.pop(key, None)
            self.stats.cancelled += 1
        self._per_client.pop(identity, None)
        self._check_idle()

    def _deadline(self, key: str) -> None:
        self._deadlines.pop(key, None)
        if key in self.requests:
            asyncio.ensure_future(self._fail(key, ErrorCode.TIMEOUT, "the request's deadline passed"))

    # ---- the iteration loop ------------------------------------------------------------------
    async def _step_loop(self, slot: EngineSlot) -> None:
        """One engine's iteration loop: schedule, run the step, stream what it produced."""
        failures = 0
        held: list[Sequence] = []  # set aside after an out-of-memory step; requeued after the next good one
        slot.link.on_lost = slot.work.set  # an engine that dies or hangs while idle wakes this loop
        while True:
            await slot.work.wait()
            if not slot.link.alive():
                await self._engine_lost(slot, getattr(slot.link, "lost_reason", None) or "the engine exited")
                continue
            if self.paused:
                slot.work.clear()  # set_paused(False) wakes us
                continue
            policy_started = time.perf_counter()
            if slot.policy_switch is not None:
                slot.apply_policy_switch(self.cache_policy, self.adapters)
            if slot.moves:
                self._carry_out_moves(slot)
            if self.replicas.due_for_rebalance():
                self._rebalance()
            sched = slot.scheduler
            plan = sched.schedule() if sched is not None else None
            if sched is not None:
                for aborted in sched.take_aborted():  # SLO early abort (S-LoRA 4.3)
                    await self._fail(aborted.request_id, ErrorCode(aborted.code), aborted.message)
            if plan is None:
                if held:  # nothing else runs: what an out-of-memory step set aside goes now
                    self._requeue_held(slot, held)
                    held = []
                    continue
                slot.work.clear()
                continue
            if self.cpu is not None and plan.merged_adapter is None:
                plan = await self.cpu.prepare(plan, self.adapters)
            self._mark_scheduled(plan, sched)
            if self.decisions is not None:
                self._log_decision(slot.index, plan)
            started = time.perf_counter()
            schedule_ms = (started - policy_started) * 1e3
            try:
                reply = await slot.link.call(EngineStep(plan=plan))
            except EngineRefused as exc:
                sched.discard_inflight()
                if exc.code == ErrorCode.OVERLOADED.value and plan.rows:  # out of memory; the engine is fine
                    held += await self._shrink_after_oom(slot, plan, str(exc))
                    continue
                failures += 1
                log.error("engine %d step failed (%d in a row): %s", slot.index, failures, exc)
                if failures >= MAX_STEP_FAILURES:
                    await self._engine_lost(slot, f"engine failed {failures} steps in a row: {exc}")
                    failures = 0
                continue
            except EngineDied as exc:
                await self._engine_lost(slot, str(exc))
                continue
            failures = 0
            if isinstance(reply, EngineStepDone):
                returned = time.perf_counter()
                await self._apply(sched, plan, reply)
                slot.observe_step(plan.num_tokens, returned - started,
                                  [self._rank_of(r.adapter) for r in plan.rows
                                   if r.adapter is not None and r.adapter != plan.merged_adapter],
                                  plan.prefill_tokens)
                self.stats.step(plan, reply.result, (returned - started) * 1e3,
                                schedule_ms + (time.perf_counter() - returned) * 1e3)
                if self.cpu is not None:
                    self.cpu.observe(plan, reply.result)
            if held:
                self._requeue_held(slot, held)
                held = []

    def _log_decision(self, engine: int, plan: StepPlan) -> None:
        def client_id(key: str) -> str:
            state = self.requests.get(key)
            return state.request_id if state is not None else key

        self.decisions.write(StepDecision(
            engine, plan.step_id, tuple(client_id(r.request_id) for r in plan.rows if r.start_pos == 0),
            tuple(client_id(r.request_id) for r in plan.rows), plan.merged_adapter))

    def _mark_scheduled(self, plan: StepPlan, sched: BaseScheduler) -> None:
        placed = {p.name for p in plan.place}
        now = time.monotonic()
        for row in plan.rows:
            state = self.requests.get(row.request_id)
            if state is not None and state.first_scheduled is None:
                state.first_scheduled = now
                if plan.merged_adapter is not None and row.adapter == plan.merged_adapter:
                    state.adapter_path = "merged"
                elif row.cpu_layers:
                    state.adapter_path = "cpu_assisted"
                elif row.adapter in placed or sched.waited_for_adapter(row.request_id):
                    state.adapter_path = "loaded"
        self.stats.placed(len(plan.place), len(plan.evict))

    async def _apply(self, sched, plan: StepPlan, reply: EngineStepDone) -> None:
        finished = {seq.request_id: seq.finish_reason for seq in sched.apply(plan, reply.result)}
        for row in reply.result.rows:
            state = self.requests.get(row.request_id)
            if state is None:
                continue
            if state.first_token_at is None:
                state.first_step_engine_ms = reply.result.forward_ms + reply.result.sample_ms
            chunk, stopped = state.on_token(row.token_id, row.logprob)
            if chunk is not None:
                await self._send(state.identity, chunk)
            if stopped:
                finished[row.request_id] = "stop"
                self._abort(row.request_id)
        for key, reason in finished.items():
            if key in self.requests:
                await self._finish(key, reason or "stop", stopped_by_string=reason == "stop")
        self.stats.tokens += len(reply.result.rows)

    def _client_done(self, identity: bytes) -> None:
        left = self._per_client.get(identity, 0) - 1
        if left > 0:
            self._per_client[identity] = left
        else:
            self._per_client.pop(identity, None)

    async def _finish(self, key: str, reason: str, *, stopped_by_string: bool = False) -> None:
        state = self.requests.pop(key, None)
        if state is None:
            return
        self._client_done(state.identity)
        self._abort(key)
        tail = state.finish_text(stopped=stopped_by_string and state.stops is not None and reason == "stop")
        if state.msg.stream and tail:
            await self._send(state.identity, TokenChunk(request_id=state.request_id, token_ids=[], text=tail,
                                                        index=len(state.token_ids)))
        done = state.done(reason)
        self.stats.finished(done)
        await self._send(state.identity, done)
        self._check_idle()

    async def _fail(self, key: str, code: ErrorCode, message: str) -> None:
        state = self.requests.pop(key, None)
        if state is None:
            return
        self._client_done(state.identity)
        self._abort(key)
        self.stats.errors += 1
        await self._send(state.identity, ErrorReply(request_id=state.request_id, code=code.value, message=message))
        self._check_idle()

    def _abort(self, key: str) -> None:
        task = self._intake.pop(key, None)
        if task is not None and task is not asyncio.current_task():
            task.cancel()  # its prompt bytes stay counted until the tokenizer thread is done with them
        timer = self._deadlines.pop(key, None)
        if timer is not None:  # a finished request's timer would hold its key until the deadline
            timer.cancel()
        for slot in self.slots:
            slot.forget(key)
        for name, held in self._held.items():
            self._held[name] = [seq for seq in held if seq.request_id != key]

    async def _send(self, identity: bytes, msg: Message) -> None:
        try:
            await self.send(identity, msg)
        except ConnectionError:
            await self.client_gone(identity)

    def _check_idle(self) -> None:
        self._departed.set()
        if not self.requests:
            self._idle.set()

    def _rank_of(self, name: str) -> int:
        entry = self.adapters.get(name)
        return entry.rank if entry is not None else 0

    def snapshot(self) -> dict[str, object]:
        scheds = [s.scheduler for s in self.slots if s.scheduler is not None]
        usages = [s.allocator.usage() for s in self.slots if s.allocator is not None]
        first = self.slots[0].scheduler

        def total(key: str) -> int:
            return sum(u.by_tag.get(key, 0) for u in usages)

        return self.stats.snapshot(
            running=sum(len(s.running) for s in scheds),
            waiting=sum(len(s.waiting) for s in scheds) + sum(len(s.pending) + len(s.carried) for s in self.slots),
            pool=None if not usages else {"total": sum(u.total for u in usages), "free": sum(u.free for u in usages),
                                          "kv": total("kv"), "adapter": total("adapter")},
            resident_adapters=sorted({n for s in scheds for n in s.adapters.resident_names()}),
            cache=first.adapters.snapshot(rank_of=self._rank_of) if first is not None else None,
            engine=self.engine.describe(),
            engines=[slot.describe() for slot in self.slots],
            router=self.router_name,
            migrations=self.replicas.migrated,
            rerouted=self.replicas.rerouted,
            load_mode=self.load_mode,
            cpu_assist=self.cpu.snapshot() if self.cpu is not None else None,
            workers=self.cpu.workers() if self.cpu is not None else [],
            draining=self.draining,
            paused=self.paused,
            preemptions=sum(s.num_preemptions for s in scheds),
            scheduler=self.policy,
            cache_policy=self.cache_policy,  # also before an engine is up (cache.policy needs one)
            running_adapters=sorted({q.req.adapter for s in scheds for q in s.running if q.req.adapter}),
            waiting_adapters=sorted({q.req.adapter for s in scheds for q in s.waiting if q.req.adapter}),
            merged_adapter=first.merged_adapter if first is not None else None,
            max_loras_per_batch=self.config.scheduler.max_loras_per_batch,
            host_tier=self.host_snapshot(),
            tokenizing=len(self._intake),
            in_flight=in_flight_rows(self.requests.values(), scheds, time.monotonic()),
            in_flight_total=len(self.requests),
            adapter_counts=self.adapter_summary(),
        )
