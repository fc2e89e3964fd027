"""One engine replica as the serving core drives it: its process link, its
page allocator and scheduler, the requests waiting for it to (re)start, and
the measurements the router reads (tokens/s, busy time).

Torch-free. The serving core owns requests and streaming; a slot owns what is
per engine, so N engines are N slots behind one router.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from loraplex.contracts.engine_spec import LoadMode
from loraplex.contracts.geometry import PageGeometry
from loraplex.daemon.adapter_table import AdapterEntry, AdapterTable
from loraplex.daemon.child_link import EngineDied, EngineRefused
from loraplex.daemon.config import LoraplexConfig
from loraplex.daemon.engine_link import EngineLink
from loraplex.daemon.gpu_cache.predictor import PredictorConfig
from loraplex.daemon.memory.allocator import PageAllocator
from loraplex.daemon.router.snapshot import StepTimes, engine_state
from loraplex.daemon.router.state import EngineState
from loraplex.daemon.scheduler.config import SchedulerConfig
from loraplex.daemon.scheduler.factory import make_scheduler
from loraplex.daemon.scheduler.sequence import SeqRequest, Sequence
from loraplex.ipc.engine_plan import StepPlan
from loraplex.ipc.plan_delta import PlanEncoder
from loraplex.ipc.protocol import (
    EngineAdapterLoaded,
    EngineHello,
    EngineLoadAdapter,
    EngineStep,
    EngineStepDelta,
    EngineUnloadAdapter,
    Message,
)

log = logging.getLogger("loraplex.daemon")
# Until an engine has run enough tokens to measure, the router assumes this rate.
DEFAULT_TOKENS_PER_S = 1000.0


class EngineSlot:
    def __init__(self, index: int, link: EngineLink, config: LoraplexConfig) -> None:
        self.index = index
        self.link = link
        self.config = config
        self.hello: EngineHello | None = None
        self.allocator: PageAllocator | None = None
        self.scheduler = None  # a daemon.scheduler policy, built when the engine is up
        self.load_mode: str = LoadMode.ON_DEMAND.value
        self.store_segment: str | None = None  # the cache manager's host store; None: the engine reads disk
        # Whether an adapter sits in the host store (set by the daemon when it has a host tier): the
        # cache predictor's guesses still on disk are not prefetched. None: every adapter counts.
        self.host_resident: Callable[[str], bool] | None = None
        self.pending: list[SeqRequest] = []  # routed here while the engine (re)starts
        self.carried: list[Sequence] = []  # sequences of a dead engine awaiting recompute
        self.work = asyncio.Event()  # set when this engine may have a step to run
        self.policy_switch: str | None = None
        self.moves: list[tuple[str, int]] = []  # (request id, target engine), done between two steps
        self.tokens = 0  # tokens computed (prefill + decode), for the router's rate
        self.busy_s = 0.0
        self.steps = 0
        self.step_times = StepTimes()  # what rank_aware reads of its steps
        # Steps go as deltas against the engine's persistent batch when its link takes them
        # (a process link does; in-process test stubs read whole plans).
        self.plans = PlanEncoder() if getattr(link, "PLAN_DELTAS", False) else None

    # ---- state ------------------------------------------------------------------------------
    @property
    def healthy(self) -> bool:
        """Up and scheduling: new requests may be routed here."""
        return self.scheduler is not None and self.link.alive()

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.busy_s if self.busy_s > 0 and self.tokens >= 64 else DEFAULT_TOKENS_PER_S

    def num_requests(self) -> int:
        sched = self.scheduler
        queued = len(self.pending) + len(self.carried)
        return queued + (len(sched.running) + len(sched.waiting) if sched is not None else 0)

    def state(self, adapters: AdapterTable) -> EngineState:
        """The router's view of this engine."""
        hello = self.hello
        max_seqs = self.config.scheduler.max_num_seqs
        if self.scheduler is None or hello is None:
            return EngineState(engine_id=self.index, max_num_seqs=max_seqs, healthy=False)

        def bytes_of(name: str, rank: int) -> int:
            entry = adapters.get(name)
            return entry.nbytes if entry is not None else 0

        link = 0.0 if self.load_mode == LoadMode.CACHED else hello.link_bytes_per_s
        return engine_state(self.index, self.scheduler, rank_of=adapters.rank_of, bytes_of=bytes_of,
                            max_num_seqs=max_seqs, total_pages=hello.num_pages, tokens_per_s=self.tokens_per_s,
                            load_bytes_per_s=link, healthy=self.healthy, steps=self.step_times, now=time.monotonic())

    def attach_store(self, segment: str) -> None:
        """The cache manager's host store: adapters come from it, and the engine, when it (re)starts,
        attaches it instead of making its own."""
        self.store_segment = segment
        self.link.store_segment = segment

    # ---- requests ---------------------------------------------------------------------------
    def enqueue(self, seq: SeqRequest) -> None:
        """Queue a new request here (held until the engine is up)."""
        if not self.healthy:
            self.pending.append(seq)
            return
        self.scheduler.add(seq)
        self.work.set()

    def adopt_sequence(self, seq: Sequence) -> None:
        """Take over a sequence from another engine (migration or a dead engine): recomputed
        from its prompt and the tokens already streamed."""
        if not self.healthy:
            self.carried.append(seq)
            return
        self.scheduler.requeue(seq)
        self.work.set()

    def forget(self, request_id: str) -> None:
        """Drop a request wherever it is queued here (cancelled, failed or finished)."""
        if self.scheduler is not None:
            self.scheduler.abort(request_id)
        self.pending = [p for p in self.pending if p.request_id != request_id]
        self.carried = [s for s in self.carried if s.request_id != request_id]

    def take_all(self) -> tuple[list[Sequence], list[SeqRequest]]:
        """Everything this engine held when it died: (sequences, requests never scheduled).
        The scheduler is gone until the engine is up again."""
        sched, self.scheduler = self.scheduler, None
        seqs = list(self.carried)
        if sched is not None:
            seqs += list(sched.running) + list(sched.waiting)
        pending, self.pending, self.carried = self.pending, [], []
        return seqs, pending

    def observe_step(self, tokens: int, seconds: float, lora_ranks: list[int] | None = None,
                     prefill_tokens: int = 0) -> None:
        """A step computed `tokens` (`prefill_tokens` of them beyond one per row) in `seconds`;
        its rows ran LoRA at `lora_ranks`."""
        self.tokens += tokens
        self.busy_s += seconds
        self.steps += 1
        self.step_times.observe(seconds * 1e3, lora_ranks or (), prefill_tokens)

    # ---- engine bring-up ----------------------------------------------------------------------
    async def bring_up(self, adapters: AdapterTable, policy: str, cache_policy: str,
                       cpu_assist_groups: int) -> EngineHello:
        """Start the engine process, build the pool and the scheduler, load every adapter;
        then queue what waited for this engine. Raises EngineDied / EngineRefused."""
        hello = await self.link.start()
        self.hello = hello
        self.resync()  # a fresh engine knows no row
        geometry = PageGeometry(kv_dim=hello.kv_dim, page_tokens=hello.page_tokens, max_row_width=hello.page_elems)
        self.allocator = PageAllocator(hello.num_pages)
        self.load_mode = hello.load_mode
        load_groups = cpu_assist_groups if self.load_mode == LoadMode.CPU_ASSIST else 1
        for name, path in hello.demo_adapters.items():  # the built-in demo's adapters, serving without --model
            if name not in adapters:
                adapters.put(AdapterEntry(name=name, path=path))
        scheduler = self.build_scheduler(policy, cache_policy, geometry, hello, load_groups, adapters)
        for entry in adapters.entries():
            if self.store_segment is None or entry.store_entry is not None:  # on disk: loaded when needed
                await self.load_adapter(entry)
        self.scheduler = scheduler
        return hello

    def step_order(self, plan: StepPlan) -> Message:
        """The order that runs `plan` on this engine: a delta against its batch where it keeps one."""
        if self.plans is None:
            return EngineStep(plan=plan)
        return EngineStepDelta(delta=self.plans.encode(plan))

    def resync(self) -> None:
        """The engine's batch is unknown (restarted, or it refused a step): the next step sends it whole."""
        if self.plans is not None:
            self.plans.reset()

    def release_waiting(self) -> None:
        """After bring-up: queue the sequences and requests that waited for this engine."""
        carried, self.carried = self.carried, []
        for seq in carried:
            self.scheduler.requeue(seq)
        pending, self.pending = self.pending, []
        for req in pending:
            self.scheduler.add(req)
        self.work.set()

    def build_scheduler(self, policy: str, cache_policy: str, geometry: PageGeometry, hello: EngineHello,
                        load_groups: int, adapters: AdapterTable):
        sched = self.config.scheduler

        def rank_of(name: str) -> int:
            return adapters.get(name).rank

        predictor = PredictorConfig(horizon_s=sched.cache_predictor_horizon_s) if sched.cache_predictor else None
        scheduler = make_scheduler(
            policy,
            SchedulerConfig(max_num_seqs=sched.max_num_seqs, max_batched_tokens=sched.max_batched_tokens,
                            max_model_len=hello.max_model_len, load_groups=load_groups,
                            max_loras_per_batch=sched.max_loras_per_batch,
                            ttft_slo_s=None if sched.ttft_slo_ms is None else sched.ttft_slo_ms / 1e3,
                            cluster_adapters=sched.cluster_adapters, cache_policy=cache_policy,
                            cache_predictor=predictor, prefix_cache=sched.prefix_cache,
                            admit_when_loaded=sched.admit_when_loaded and self.load_mode == LoadMode.ON_DEMAND,
                            kv_window=hello.kv_window),
            geometry, self.allocator, adapters.pages, tuple(hello.eos_token_ids), adapter_rank=rank_of,
        )
        scheduler.adapters.host_resident = self.host_resident
        return scheduler

    def apply_policy_switch(self, cache_policy: str, adapters: AdapterTable) -> None:
        """Swap in the policy named by `policy_switch`, between two steps; queues carry over."""
        name, self.policy_switch = self.policy_switch, None
        old = self.scheduler
        if name is None or old is None or self.hello is None:
            return
        fresh = self.build_scheduler(name, cache_policy, old.geometry, self.hello, old.config.load_groups, adapters)
        fresh.adopt(old)
        self.scheduler = fresh
        log.info("engine %d: scheduler switched to %s", self.index, name)

    async def load_adapter(self, entry: AdapterEntry, *, keep_resident: bool = False) -> None:
        """Have the engine take the adapter (from the host store when it sits there, else from
        disk, validating it); the entry records what it reported. keep_resident: same content
        as the engine's copy, which keeps its GPU pages."""
        order = EngineLoadAdapter(name=entry.name, path=entry.path)
        if self.store_segment is not None and entry.store_entry is not None:
            order = EngineLoadAdapter(name=entry.name, path=entry.path, store_segment=self.store_segment,
                                      store_entry=entry.store_entry, keep_resident=keep_resident)
        try:
            reply = await self.link.call(order)
        except EngineRefused as exc:
            entry.failed(str(exc))
            log.warning("adapter %s failed to load on engine %d: %s", entry.name, self.index, exc)
            return
        if isinstance(reply, EngineAdapterLoaded):
            entry.loaded(reply)

    async def unload_adapter(self, name: str) -> None:
        if self.scheduler is not None:
            self.scheduler.adapters.forget(name)
        if self.link.alive():
            try:
                await self.link.call(EngineUnloadAdapter(name=name))
            except EngineRefused as exc:
                log.warning("engine %d could not unload %s: %s", self.index, name, exc)

    async def drop_adapter(self, name: str) -> None:
        """Host-tier eviction: the engine drops its host copy and the GPU copy, if unreferenced
        (a referenced stale copy goes with its last reference); usage counters stay."""
        if self.scheduler is not None and not self.scheduler.adapters.refs(name):
            self.scheduler.adapters.drop(name)
        if self.link.alive():
            try:
                await self.link.call(EngineUnloadAdapter(name=name))
            except (EngineRefused, EngineDied) as exc:
                log.warning("engine %d could not drop %s: %s", self.index, name, exc)

    async def preload(self, adapters: AdapterTable) -> None:
        """cached mode: every ready adapter is placed once and never evicted (its reference is kept);
        one still on disk (the host store is full) is loaded on demand."""
        for entry in adapters.entries():
            if self.store_segment is not None and entry.store_entry is None:
                continue
            if entry.state == "ready" and not self.scheduler.adapters.is_resident(entry.name):
                if not self.scheduler.adapters.acquire(entry.name, entry.num_pages):
                    log.warning("cached mode: no pool room for adapter %s on engine %d; it will load on demand",
                                entry.name, self.index)
        await self.flush_placements()

    async def flush_placements(self) -> None:
        """Send pending adapter placements (no rows) when no step is in flight."""
        plan = self.scheduler.placement_plan()
        if plan is not None:
            await self.link.call(EngineStep(plan=plan))

    def describe(self) -> dict[str, object]:
        info = self.link.describe()
        usage = self.allocator.usage() if self.allocator is not None else None
        sched = self.scheduler
        info.update({
            "healthy": self.healthy, "steps": self.steps, "tokens": self.tokens,
            "tokens_per_s": self.tokens / self.busy_s if self.busy_s > 0 else 0.0,
            # The engine row of `loraplex top`: recent step time (a moving average; None before the
            # first step) and the batch now, the sequences in it.
            "step_ms": self.step_times.mean_ms if self.steps else None,
            "batch_rows": len(sched.running) if sched else 0,
            "running": len(sched.running) if sched else 0,
            "waiting": (len(sched.waiting) if sched else 0) + len(self.pending) + len(self.carried),
            "pool_used_pct": (None if usage is None or not usage.total
                              else (usage.total - usage.free) / usage.total * 100),
            "resident_adapters": len(sched.adapters.resident_names()) if sched else 0,
            "prefix_cache": sched.prefix.snapshot() if sched is not None and sched.prefix is not None else None,
        })
        return info

