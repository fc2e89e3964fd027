"""The serving core: admits client requests, runs the iteration loop (schedule →
engine step → stream tokens), and survives engine deaths.

Torch-free and socket-free: replies go out through the `send` callback the
server gives it, so tests can drive it with a fake transport. The engine is
an executor behind EngineLink; every policy decision is made here.
"""
from __future__ import annotations

import asyncio
import logging
import secrets
import time
from typing import Awaitable, Callable

from loraplex.daemon.adapter_table import AdapterEntry, AdapterTable
from loraplex.daemon.config import LoraplexConfig
from loraplex.daemon.detokenizer import IncrementalDetokenizer, StopStringMatcher, load_tokenizer
from loraplex.daemon.engine_link import EngineDied, EngineLink, EngineRefused
from loraplex.daemon.memory.allocator import PageAllocator
from loraplex.daemon.memory.geometry import PageGeometry
from loraplex.daemon.request_state import ClientRequest
from loraplex.daemon.scheduler.config import SchedulerConfig
from loraplex.daemon.cache.policies import POLICY_NAMES
from loraplex.daemon.scheduler.factory import POLICIES, make_scheduler
from loraplex.daemon.scheduler.sequence import SeqRequest
from loraplex.daemon.stats import ServingStats
from loraplex.errors import CapacityError
from loraplex.ipc.engine_plan import SamplingSpec, StepPlan
from loraplex.ipc.errors import ErrorCode
from loraplex.ipc.protocol import (
    EngineAdapterLoaded,
    EngineFailure,
    EngineHello,
    EngineLoadAdapter,
    EngineStep,
    EngineStepDone,
    EngineUnloadAdapter,
    ErrorReply,
    GenerateRequest,
    Message,
    TokenChunk,
)

log = logging.getLogger("loraplex.daemon")
Send = Callable[[bytes, Message], Awaitable[None]]
MAX_STEP_FAILURES = 3
MAX_ENGINE_RETRIES = 2


class Rejected(Exception):
    """A request or admin order is refused with a stable error code."""

    def __init__(self, code: ErrorCode | str, message: str) -> None:
        super().__init__(message)
        self.code = ErrorCode(code).value
        self.message = message


class ServingCore:
    def __init__(self, config: LoraplexConfig, engine: EngineLink, send: Send,
                 make_cpu_pool: Callable[[], object] | None = None) -> None:
        self.config = config
        self.engine = engine
        self.send = send
        self._make_cpu_pool = make_cpu_pool
        self.cpu = None  # CpuAssistDriver in cpu_assist mode
        self.load_mode = "on_demand"
        self.policy = config.scheduler.policy
        self._policy_switch: str | None = None
        self.cache_policy = config.scheduler.cache_policy
        self.adapters = AdapterTable()
        self.requests: dict[str, ClientRequest] = {}
        self.stats = ServingStats()
        self.scheduler = None  # the policy built by make_scheduler once the engine is up
        self.allocator: PageAllocator | None = None
        self.hello: EngineHello | None = None
        self.tokenizer = None
        self.draining = False
        self._pending: list[SeqRequest] = []  # accepted while the engine (re)starts
        self._carried: list = []  # Sequences of a dead engine awaiting recompute
        self._work = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._per_client: dict[bytes, int] = {}  # identity -> requests in flight
        self._loop_task: asyncio.Task | None = None

    # ---- lifecycle --------------------------------------------------------------------------
    async def start(self, adapters: list[tuple[str, str, bool]]) -> None:
        """Start the engine, register `adapters` (name, path, pinned) with it, start stepping."""
        for name, path, pinned in adapters:
            self.adapters.put(AdapterEntry(name=name, path=path, pinned=pinned))
        await self._engine_up()
        self._loop_task = asyncio.create_task(self._step_loop(), name="step-loop")

    async def _engine_up(self) -> None:
        hello = await self.engine.start()
        self.hello = hello
        self.stats.link_bytes_per_s = hello.link_bytes_per_s
        if self.tokenizer is None:
            self.tokenizer = load_tokenizer(hello.model_dir)
        geometry = PageGeometry(kv_dim=hello.kv_dim, page_tokens=hello.page_tokens, max_row_width=hello.page_elems)
        self.allocator = PageAllocator(hello.num_pages)
        self.load_mode = hello.load_mode
        groups = self.config.model.load_groups if self.load_mode == "cpu_assist" else 1
        self.scheduler = self._build_scheduler(self.policy, geometry, hello, groups)
        for name, path in hello.demo_adapters.items():  # the built-in demo's adapters, serving without --model
            if name not in self.adapters:
                self.adapters.put(AdapterEntry(name=name, path=path))
        for entry in self.adapters.entries():
            await self._load_into_engine(entry)
        if self.load_mode == "cpu_assist":
            await self._start_cpu_assist(hello)
        if self.load_mode == "cached":
            await self._preload_all()
        carried, self._carried = self._carried, []
        for seq in carried:  # requests of a dead engine, recomputed from prompt + tokens so far
            if seq.request_id in self.requests:
                self.scheduler.requeue(seq)
        pending, self._pending = self._pending, []
        for req in pending:
            self._enqueue(req)

    def _build_scheduler(self, policy: str, geometry: PageGeometry, hello: EngineHello, groups: int):
        sched = self.config.scheduler
        return make_scheduler(
            policy,
            SchedulerConfig(max_num_seqs=sched.max_num_seqs, max_batched_tokens=sched.max_batched_tokens,
                            max_model_len=hello.max_model_len, load_groups=groups,
                            max_loras_per_batch=sched.max_loras_per_batch,
                            ttft_slo_s=None if sched.ttft_slo_ms is None else sched.ttft_slo_ms / 1e3,
                            cluster_adapters=sched.cluster_adapters, cache_policy=self.cache_policy),
            geometry, self.allocator, self.adapters.pages, tuple(hello.eos_token_ids),
            adapter_rank=lambda name: self.adapters.get(name).rank,
        )

    def set_policy(self, name: str) -> None:
        """Switch the scheduling policy at run time; takes effect before the next step."""
        if name not in POLICIES:
            raise Rejected(ErrorCode.INVALID_FIELD, f"unknown scheduler {name!r}; choose one of {POLICIES}")
        self.policy = name
        self._policy_switch = name
        self._work.set()

    def set_cache_policy(self, name: str) -> None:
        """Switch the GPU adapter cache policy at run time; resident adapters stay."""
        if name not in POLICY_NAMES:
            raise Rejected(ErrorCode.INVALID_FIELD, f"unknown cache policy {name!r}; choose one of {POLICY_NAMES}")
        self.cache_policy = name
        if self.scheduler is not None:
            self.scheduler.adapters.set_policy(name)

    def pin_adapter(self, name: str, pinned: bool) -> None:
        if self.scheduler is not None:
            (self.scheduler.adapters.pin if pinned else self.scheduler.adapters.unpin)(name)

    def _apply_policy_switch(self) -> None:
        name, self._policy_switch = self._policy_switch, None
        old = self.scheduler
        if name is None or old is None or self.hello is None:
            return
        fresh = self._build_scheduler(name, old.geometry, self.hello, old.config.load_groups)
        fresh.adopt(old)
        self.scheduler = fresh
        log.info("scheduler switched to %s", name)

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

    async def _preload_all(self) -> None:
        """cached mode: every ready adapter is placed once and never evicted (its reference is kept)."""
        for entry in self.adapters.entries():
            if entry.state == "ready" and not self.scheduler.adapters.is_resident(entry.name):
                if not self.scheduler.adapters.acquire(entry.name, entry.num_pages):
                    log.warning("cached mode: no pool room for adapter %s; it will load on demand", entry.name)
        plan = self.scheduler.placement_plan()
        if plan is not None:
            await self.engine.call(EngineStep(plan=plan))

    async def _load_into_engine(self, entry: AdapterEntry) -> None:
        try:
            reply = await self.engine.call(EngineLoadAdapter(name=entry.name, path=entry.path))
        except EngineRefused as exc:
            entry.failed(str(exc))
            log.warning("adapter %s failed to load: %s", entry.name, exc)
            return
        if isinstance(reply, EngineAdapterLoaded):
            entry.loaded(reply)

    async def stop(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
            try:
                await self._loop_task
            except asyncio.CancelledError:
                pass
        for key in list(self.requests):
            await self._fail(key, ErrorCode.SHUTTING_DOWN, "the daemon is shutting down")
        await self.engine.stop()
        if self.cpu is not None:
            await self.cpu.pool.stop()

    async def drain(self, timeout_s: float) -> bool:
        """Stop admitting; wait up to `timeout_s` for in-flight requests. True if all finished."""
        self.draining = True
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
            return True
        except asyncio.TimeoutError:
            return False

    # ---- requests ---------------------------------------------------------------------------
    async def submit(self, identity: bytes, msg: GenerateRequest) -> None:
        if self.draining:
            raise Rejected(ErrorCode.SHUTTING_DOWN, "the daemon is draining and accepts no new requests")
        if len(self.requests) >= self.config.server.max_clients_inflight:
            raise Rejected(ErrorCode.OVERLOADED, f"{len(self.requests)} requests in flight; try again later")
        key = _key(identity, msg.request_id)
        per_client = self._per_client.get(identity, 0)
        if per_client >= self.config.server.max_requests_per_client:
            raise Rejected(ErrorCode.OVERLOADED,
                           f"this client already has {per_client} requests in flight (server.max_requests_per_client)")
        if key in self.requests:
            raise Rejected(ErrorCode.DUPLICATE_REQUEST, f"request id {msg.request_id!r} is already in flight")
        if msg.adapter is not None:
            entry = self.adapters.get(msg.adapter)
            if entry is None:
                raise Rejected(ErrorCode.UNKNOWN_ADAPTER, f"unknown adapter {msg.adapter!r}")
            if entry.state != "ready":
                raise Rejected(ErrorCode.INVALID_ADAPTER, f"adapter {msg.adapter!r} is not usable: {entry.error}")
        prompt_ids = self._prompt_ids(msg)
        state = ClientRequest(
            key=key, identity=identity, msg=msg, prompt_ids=prompt_ids,
            detok=IncrementalDetokenizer(self.tokenizer) if self.tokenizer is not None else None,
            stops=StopStringMatcher(list(msg.stop)) if msg.stop else None,
            adapter_path="base" if msg.adapter is None else "cached",
        )
        seq = SeqRequest(
            request_id=key, prompt_ids=prompt_ids, adapter=msg.adapter,
            sampling=SamplingSpec(temperature=msg.temperature if msg.top_k != 1 else 0.0, top_p=msg.top_p,
                                  top_k=msg.top_k, seed=msg.seed if msg.seed is not None else secrets.randbits(63),
                                  logprobs=msg.logprobs),
            max_tokens=msg.max_tokens, stop_token_ids=frozenset(msg.stop_token_ids), ignore_eos=msg.ignore_eos,
            ttft_slo_s=None if msg.slo_ttft_ms is None else msg.slo_ttft_ms / 1e3,
        )
        self.requests[key] = state
        self._per_client[identity] = per_client + 1
        self._idle.clear()
        try:
            self._enqueue(seq)
        except CapacityError as exc:
            del self.requests[key]
            self._client_done(identity)
            self._check_idle()
            raise Rejected(ErrorCode.TOO_LARGE, str(exc)) from None
        self.stats.accepted(msg.adapter)
        if msg.adapter is not None and self.scheduler is not None:
            self.scheduler.adapters.note_arrival(msg.adapter)
        if msg.adapter is not None:
            self.adapters.get(msg.adapter).requests += 1
        if msg.deadline_ms is not None:
            asyncio.get_running_loop().call_later(msg.deadline_ms / 1e3, self._deadline, key)

    def _prompt_ids(self, msg: GenerateRequest) -> list[int]:
        if msg.prompt is not None:
            if self.tokenizer is None:
                raise Rejected(ErrorCode.INVALID_FIELD, "this model has no tokenizer.json; send prompt_token_ids")
            ids = self.tokenizer.encode(msg.prompt).ids
            if not ids:
                raise Rejected(ErrorCode.INVALID_FIELD, "the prompt encodes to no tokens")
        else:
            ids = list(msg.prompt_token_ids or [])
        vocab = self.hello.vocab_size if self.hello else 0
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise Rejected(ErrorCode.INVALID_TOKEN, f"token id {bad} is outside the vocabulary (size {vocab})")
        limit = self.hello.max_model_len if self.hello else 0
        if len(ids) >= limit:
            raise Rejected(ErrorCode.PROMPT_TOO_LONG,
                           f"prompt has {len(ids)} tokens; the context holds {limit} (prompt + at least 1 new token)")
        return ids

    def _enqueue(self, seq: SeqRequest) -> None:
        if self.scheduler is None or not self.engine.alive():
            self._pending.append(seq)
            return
        self.scheduler.add(seq)
        self._work.set()

    async def cancel(self, identity: bytes, request_id: str) -> bool:
        key = _key(identity, request_id)
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
        if key in self.requests:
            asyncio.ensure_future(self._fail(key, ErrorCode.TIMEOUT, "the request's deadline passed"))

    # ---- the iteration loop ------------------------------------------------------------------
    async def _step_loop(self) -> None:
        failures = 0
        while True:
            await self._work.wait()
            policy_started = time.perf_counter()
            if self._policy_switch is not None:
                self._apply_policy_switch()
            plan = self.scheduler.schedule() if self.scheduler is not None else None
            if self.scheduler is not None:
                for aborted in self.scheduler.take_aborted():  # SLO early abort (S-LoRA 4.3)
                    await self._fail(aborted.request_id, ErrorCode(aborted.code), aborted.message)
            if plan is None:
                self._work.clear()
                continue
            if self.cpu is not None and plan.merged_adapter is None:
                plan = await self.cpu.prepare(plan, self.adapters)
            self._mark_scheduled(plan)
            started = time.perf_counter()
            schedule_ms = (started - policy_started) * 1e3
            try:
                reply = await self.engine.call(EngineStep(plan=plan))
            except EngineRefused as exc:
                self.scheduler.discard_inflight()
                failures += 1
                log.error("engine step failed (%d in a row): %s", failures, exc)
                if failures >= MAX_STEP_FAILURES:
                    await self._engine_lost(f"engine failed {failures} steps in a row: {exc}")
                    failures = 0
                continue
            except EngineDied as exc:
                await self._engine_lost(str(exc))
                continue
            failures = 0
            if isinstance(reply, EngineStepDone):
                returned = time.perf_counter()
                await self._apply(plan, reply)
                self.stats.step(plan, reply.result, (returned - started) * 1e3,
                                schedule_ms + (time.perf_counter() - returned) * 1e3)
                if self.cpu is not None:
                    self.cpu.observe(plan, reply.result)

    def _mark_scheduled(self, plan: StepPlan) -> None:
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
                elif row.adapter in placed:
                    state.adapter_path = "loaded"
        self.stats.placed(len(plan.place), len(plan.evict))

    async def _apply(self, plan: StepPlan, reply: EngineStepDone) -> None:
        finished = {seq.request_id: seq.finish_reason for seq in self.scheduler.apply(plan, reply.result)}
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
        if self.scheduler is not None:
            self.scheduler.abort(key)
        self._pending = [p for p in self._pending if p.request_id != key]
        self._carried = [s for s in self._carried if s.request_id != key]

    async def _send(self, identity: bytes, msg: Message) -> None:
        try:
            await self.send(identity, msg)
        except ConnectionError:
            await self.client_gone(identity)

    def _check_idle(self) -> None:
        if not self.requests:
            self._idle.set()

    # ---- engine failure -----------------------------------------------------------------------
    async def _engine_lost(self, reason: str) -> None:
        """Restart a dead engine; its requests are recomputed from their prompt and the tokens
        already streamed (up to MAX_ENGINE_RETRIES times each), so nothing is lost or repeated."""
        log.error("engine lost: %s", reason)
        self.stats.engine_restarts += 1
        sched, self.scheduler = self.scheduler, None
        if sched is not None:
            for seq in list(sched.running) + list(sched.waiting):
                state = self.requests.get(seq.request_id)
                if state is None:
                    continue
                state.engine_retries += 1
                if state.engine_retries > MAX_ENGINE_RETRIES:
                    await self._fail(seq.request_id, ErrorCode.ENGINE_FAILED,
                                     f"the engine failed {state.engine_retries} times while running this request "
                                     f"({reason})")
                else:
                    self._carried.append(seq)
        delay = 0.5
        while True:
            try:
                await self._engine_up()
                log.info("engine restarted")
                self._work.set()
                return
            except (EngineDied, EngineRefused, OSError) as exc:
                log.error("engine restart failed: %s; retrying in %.1f s", exc, delay)
                carried, self._carried = self._carried, []
                for seq in carried:
                    await self._fail(seq.request_id, ErrorCode.UNAVAILABLE, f"the engine could not be restarted: {exc}")
                for seq in list(self._pending):
                    await self._fail(seq.request_id, ErrorCode.UNAVAILABLE, f"the engine could not be restarted: {exc}")
                await asyncio.sleep(delay)
                delay = min(delay * 2, 30.0)

    # ---- adapters ---------------------------------------------------------------------------
    async def add_adapter(self, name: str, path: str, pinned: bool = False) -> AdapterEntry:
        if name in self.adapters:
            raise Rejected(ErrorCode.ALREADY_EXISTS, f"adapter {name!r} is already registered")
        entry = AdapterEntry(name=name, path=path, pinned=pinned)
        if self.engine.alive():
            await self._load_into_engine(entry)
            if entry.state != "ready":
                raise Rejected(ErrorCode.INVALID_ADAPTER, entry.error or "the engine refused the adapter")
        self.adapters.put(entry)
        if self.load_mode == "cached" and self.scheduler is not None and entry.state == "ready":
            self.scheduler.adapters.acquire(name, entry.num_pages)  # placed with the next step, kept for good
        return entry

    async def remove_adapter(self, name: str) -> None:
        entry = self.adapters.get(name)
        if entry is None:
            raise Rejected(ErrorCode.NOT_FOUND, f"unknown adapter {name!r}")
        users = [s for s in self.requests.values() if s.msg.adapter == name]
        if users:
            raise Rejected(ErrorCode.INVALID_FIELD, f"adapter {name!r} is used by {len(users)} requests in flight")
        if self.scheduler is not None:
            self.scheduler.adapters.forget(name)
        self.adapters.pop(name)
        if self.engine.alive():
            try:
                await self.engine.call(EngineUnloadAdapter(name=name))
            except EngineRefused as exc:
                log.warning("engine could not unload %s: %s", name, exc)

    def adapter_list(self) -> list[dict[str, object]]:
        residency = self.scheduler.adapters if self.scheduler is not None else None
        return [e.to_wire(resident=bool(residency and residency.is_resident(e.name)),
                          refs=residency.refs(e.name) if residency else 0) for e in self.adapters.entries()]

    def _rank_of(self, name: str) -> int:
        entry = self.adapters.get(name)
        return entry.rank if entry is not None else 0

    def snapshot(self) -> dict[str, object]:
        usage = self.allocator.usage() if self.allocator is not None else None
        sched = self.scheduler
        return self.stats.snapshot(
            running=len(sched.running) if sched else 0,
            waiting=(len(sched.waiting) if sched else 0) + len(self._pending),
            pool=None if usage is None else {"total": usage.total, "free": usage.free,
                                             "kv": usage.by_tag.get("kv", 0),
                                             "adapter": usage.by_tag.get("adapter", 0)},
            resident_adapters=sched.adapters.resident_names() if sched else [],
            cache=sched.adapters.snapshot(rank_of=self._rank_of) if sched else None,
            engine=self.engine.describe(),
            load_mode=self.load_mode,
            cpu_assist=self.cpu.snapshot() if self.cpu is not None else None,
            workers=self.cpu.workers() if self.cpu is not None else [],
            draining=self.draining,
            preemptions=sched.num_preemptions if sched else 0,
            scheduler=self.policy,
            running_adapters=sorted({s.req.adapter for s in sched.running if s.req.adapter}) if sched else [],
            waiting_adapters=sorted({s.req.adapter for s in sched.waiting if s.req.adapter}) if sched else [],
            merged_adapter=sched.merged_adapter if sched else None,
            max_loras_per_batch=self.config.scheduler.max_loras_per_batch,
        )


def _key(identity: bytes, request_id: str) -> str:
    return identity.hex() + "/" + request_id

