"""Discrete-event simulator of N engines driven by the daemon's own policy classes (torch-free).

Each simulated engine runs a real scheduler from `make_scheduler` (with its real adapter
cache) on a shared virtual clock; a real router places arrivals. Only execution is modelled
(SimProfile): a step's duration, adapter loads on a per-engine host->GPU link, and in
cpu_assist mode the CPU computing a cold adapter's LoRA delta instead of the step waiting
for its load. The per-step admissions are recorded (SimResult.decisions) so a live daemon
fed the same trace can be checked against them. Never sleeps, never reads a real clock.
"""
from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from loraplex.contracts.engine_spec import LoadMode
from loraplex.contracts.geometry import PageGeometry
from loraplex.daemon.memory.allocator import PageAllocator
from loraplex.daemon.router import ROUTERS, EngineState, RequestInfo, Router, make_router
from loraplex.daemon.router.snapshot import StepTimes, engine_state
from loraplex.daemon.scheduler.base import BaseScheduler
from loraplex.daemon.scheduler.config import DEFAULT_OVERLAP, SchedulerConfig
from loraplex.daemon.scheduler.factory import POLICIES, make_scheduler
from loraplex.daemon.scheduler.sequence import SeqRequest
from loraplex.daemon.sim.lcfs import LcfsScheduler
from loraplex.daemon.sim.profile import SimProfile
from loraplex.daemon.sim.workload import RequestEvent, prompt_tokens
from loraplex.ipc.engine_plan import RowPlan, RowResult, SamplingSpec, StepPlan, StepResult

MODES = tuple(mode.value for mode in LoadMode if mode is not LoadMode.AUTO)
SIM_POLICIES = (*POLICIES, "lcfs")  # lcfs: a baseline only the simulator offers (lcfs.py)
_TOKEN = 3  # what the simulated model samples (requests ignore EOS; lengths come from the workload)
PROGRESS_EVERY = 4096  # event-loop turns between progress reports


@dataclass(frozen=True, slots=True)
class SimConfig:
    policy: str = "fcfs"  # scheduler: fcfs | mlq | dlora | lcfs
    cache_policy: str = "lru"  # none | lru | fifo | cost
    mode: str = LoadMode.ON_DEMAND.value  # cached (loads are free) | on_demand (steps wait) | cpu_assist
    router: str = "most_idle"
    num_engines: int = 1
    ttft_slo_ms: float = 2000.0
    tpt_slo_ms: float = 100.0
    early_abort: bool = False  # pass the TTFT SLO to the scheduler (S-LoRA early abort)
    cluster_adapters: bool = False
    max_loras_per_batch: int = 0
    prefetch: bool = True
    admit_when_loaded: bool = True  # on_demand: a request waits in the queue while its adapter loads
    prefix_cache: bool = True  # automatic prefix caching, as scheduler.prefix_cache
    prefix_eviction: str = "unified"  # unified | separate (SchedulerConfig.prefix_eviction)
    overlap: bool = DEFAULT_OVERLAP  # plan each step while the one before runs, as scheduler.overlap does
    max_steps: int = 2_000_000

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.policy not in SIM_POLICIES:
            raise ValueError(f"unknown scheduling policy {self.policy!r}; choose one of {', '.join(SIM_POLICIES)}")
        if self.router not in ROUTERS:
            raise ValueError(f"unknown router {self.router!r}; choose one of {', '.join(ROUTERS)}")
        if self.num_engines <= 0 or self.ttft_slo_ms <= 0 or self.tpt_slo_ms <= 0 or self.max_steps <= 0:
            raise ValueError("num_engines, SLOs and max_steps must be positive")


@dataclass(frozen=True, slots=True)
class Decision:
    """One planned step: which requests it admitted (first chunk from position 0) and ran."""

    engine: int
    step_id: int
    time_s: float
    admitted: tuple[str, ...]
    rows: tuple[str, ...]
    merged_adapter: str | None = None


@dataclass(slots=True)
class RequestRecord:
    event: RequestEvent
    engine: int
    first_token_s: float | None = None
    finish_s: float | None = None
    output_tokens: int = 0
    aborted: bool = False

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.event.arrival_s

    @property
    def tpt_s(self) -> float | None:
        if self.finish_s is None or self.first_token_s is None:
            return None
        return (self.finish_s - self.first_token_s) / max(1, self.output_tokens - 1)

    @property
    def e2e_s(self) -> float | None:
        return None if self.finish_s is None else self.finish_s - self.event.arrival_s


@dataclass(slots=True)
class SimResult:
    config: SimConfig
    profile: SimProfile
    records: list[RequestRecord]
    decisions: list[Decision]
    makespan_s: float
    pcie_bytes: int
    cache_hits: int
    cache_misses: int
    steps: int
    prefix: dict[str, int] = field(default_factory=dict)  # prefix-cache counters summed over engines


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@dataclass(slots=True)
class _Engine:
    index: int
    sched: BaseScheduler
    ready_at: dict[str, float] = field(default_factory=dict)  # adapter -> when its load completes
    link_free: float = 0.0
    plan: StepPlan | None = None
    ahead: StepPlan | None = None  # overlap: planned (and launched) while `plan` runs
    started: float = 0.0
    end: float = 0.0
    busy_s: float = 0.0
    tokens: int = 0
    step_times: StepTimes = field(default_factory=StepTimes)  # what rank_aware reads of its steps


class Simulator:
    def __init__(self, config: SimConfig, profile: SimProfile | None = None) -> None:
        self.config = config
        self.profile = profile or SimProfile()
        self.clock = _Clock()
        self.router = self._make_router()
        self.records: dict[str, RequestRecord] = {}
        self.decisions: list[Decision] = []
        self.pcie_bytes = 0
        self.steps = 0
        self._ranks: dict[str, int] = {}
        self._prompt_len: dict[str, int] = {}  # request id -> prompt tokens as queued
        self._conversations: dict[str, list[int]] = {}  # conversation -> its token stream
        self._conversation_of_request: dict[str, str] = {}
        self._ended = 0  # requests finished or aborted
        self.engines = [_Engine(i, self._make_scheduler()) for i in range(config.num_engines)]
        # Router snapshots, rebuilt only for engines whose scheduler changed since (add, schedule,
        # apply): with many engines, rebuilding all of them per arrival dominated the run time.
        self._states: list[EngineState | None] = [None] * config.num_engines

    def _make_router(self) -> Router:
        c, p = self.config, self.profile
        if c.router == "rank_aware":
            # Predict with the simulated engines' own step model and judge against the TPT SLO
            # being measured (the daemon passes its profile file and scheduler.tpt_slo_ms the
            # same way), not with the router's illustrative defaults.
            return make_router(c.router, profile=p.perf, kernel=p.kernel, slo_ms=c.tpt_slo_ms)
        return make_router(c.router)

    def _make_scheduler(self) -> BaseScheduler:
        p, c = self.profile, self.config
        sched_cfg = SchedulerConfig(
            max_num_seqs=p.max_num_seqs, max_batched_tokens=p.max_batched_tokens, max_model_len=p.max_model_len,
            cache_policy=c.cache_policy, prefetch=c.prefetch, cluster_adapters=c.cluster_adapters,
            max_loras_per_batch=c.max_loras_per_batch, ttft_slo_s=c.ttft_slo_ms / 1e3 if c.early_abort else None,
            admit_when_loaded=c.admit_when_loaded and c.mode == LoadMode.ON_DEMAND,
            prefix_cache=c.prefix_cache, prefix_eviction=c.prefix_eviction)
        geometry = PageGeometry(kv_dim=1, page_tokens=p.page_tokens, max_row_width=0)

        def pages(name: str) -> int:
            return p.adapter_pages(self._ranks[name])

        if c.policy == "lcfs":
            return LcfsScheduler(sched_cfg, geometry, PageAllocator(p.pool_pages), pages,
                                 adapter_rank=self._ranks.__getitem__, clock=self.clock)
        return make_scheduler(c.policy, sched_cfg, geometry, PageAllocator(p.pool_pages), pages, (),
                              adapter_rank=self._ranks.__getitem__, clock=self.clock)

    # ---- the event loop ----------------------------------------------------------------------
    def run(self, events: list[RequestEvent], progress: Callable[[float], None] | None = None) -> SimResult:
        """Serve `events` to the end; `progress` gets the share of the work done (arrivals and
        completions, 0..1) every PROGRESS_EVERY events."""
        pending = sorted(events, key=lambda e: (e.arrival_s, e.request_id))
        for e in pending:
            if e.adapter is not None:
                self._ranks[e.adapter] = e.rank
        # Only engines something happened to are visited (a step ended, a request arrived, or they
        # sit idle with work they could not start, which is retried at every event because
        # admission may depend on the time); in index order, as a full scan would.
        busy: list[tuple[float, int]] = []  # heap of (step end, engine index)
        stuck: set[int] = set()
        i = 0
        ticks = 0
        while True:
            ticks += 1
            if progress is not None and ticks % PROGRESS_EVERY == 0:
                progress((i + self._ended) / max(1, 2 * len(pending)))
            touched = set(stuck)
            done = []
            while busy and busy[0][0] <= self.clock.now:
                done.append(heapq.heappop(busy)[1])
            for index in sorted(done):
                self._complete(self.engines[index])
            touched.update(done)
            while i < len(pending) and pending[i].arrival_s <= self.clock.now:
                self._arrive(pending[i])
                touched.add(self.records[pending[i].request_id].engine)
                i += 1
            stuck.clear()
            for index in sorted(touched):
                eng = self.engines[index]
                if eng.plan is None and (eng.ahead is not None or eng.sched.has_work()):
                    self._start(eng)
                    if eng.plan is not None:
                        heapq.heappush(busy, (eng.end, index))
                    elif eng.sched.has_work():
                        stuck.add(index)
            times = [busy[0][0]] if busy else []
            if i < len(pending):
                times.append(pending[i].arrival_s)
            if not times:
                if stuck:
                    raise RuntimeError("simulation stalled: queued requests that can never be scheduled")
                break
            self.clock.now = max(self.clock.now, min(times))
            if self.steps > self.config.max_steps:
                raise RuntimeError(f"simulation did not finish within {self.config.max_steps} steps")
        hits = sum(e.sched.adapters.totals.hits for e in self.engines)
        misses = sum(e.sched.adapters.totals.misses for e in self.engines)
        prefix: dict[str, int] = {}
        for eng in self.engines:
            if eng.sched.prefix is not None:
                for key, value in asdict(eng.sched.prefix.counters).items():
                    prefix[key] = prefix.get(key, 0) + value
        return SimResult(self.config, self.profile, [self.records[e.request_id] for e in pending], self.decisions,
                         self.clock.now, self.pcie_bytes, hits, misses, self.steps, prefix)

    def _arrive(self, ev: RequestEvent) -> None:
        p = self.profile
        prompt = max(1, min(ev.prompt_len, p.max_model_len - 1))
        info = RequestInfo(request_id=ev.request_id, adapter=ev.adapter, rank=ev.rank, prompt_len=prompt,
                           max_tokens=ev.output_len, adapter_bytes=p.adapter_bytes(ev.rank))
        index = self.router.choose(info, [self._state(e) for e in self.engines])
        eng = self.engines[index]
        self.records[ev.request_id] = RequestRecord(ev, index)
        self._states[index] = None
        self._prompt_len[ev.request_id] = prompt
        eng.sched.add(SeqRequest(request_id=ev.request_id, prompt_ids=self._stream(ev, prompt), adapter=ev.adapter,
                                 sampling=SamplingSpec(temperature=0.0), max_tokens=ev.output_len, ignore_eos=True))

    def _stream(self, ev: RequestEvent, length: int) -> list[int]:
        """The first `length` tokens of the request's prompt stream (its conversation's, for a turn)."""
        if ev.conversation is None:
            return prompt_tokens(ev.request_id, length)
        stream = self._conversations.get(ev.conversation)
        if stream is None:
            stream = self._conversations[ev.conversation] = prompt_tokens(ev.conversation, self.profile.max_model_len)
        self._conversation_of_request[ev.request_id] = ev.conversation
        return stream[:length]

    def _sampled(self, row: RowPlan) -> int:
        """What the simulated model samples: a conversation turn continues its conversation's stream
        (so the next turn's prompt holds this turn's answer, as a chat history does); others _TOKEN."""
        conversation = self._conversation_of_request.get(row.request_id)
        if conversation is None:
            return _TOKEN
        stream = self._conversations[conversation]
        position = row.start_pos + len(row.token_ids)
        return stream[position] if position < len(stream) else _TOKEN

    def _state(self, eng: _Engine) -> EngineState:
        state = self._states[eng.index]
        if state is None:
            state = self._states[eng.index] = self._snapshot(eng)
        return state

    def _snapshot(self, eng: _Engine) -> EngineState:
        p = self.profile
        rate = eng.tokens / eng.busy_s if eng.busy_s > 0 else 1e3 / max(p.prefill_ms_per_token, 1e-6)
        return engine_state(eng.index, eng.sched, rank_of=self._ranks.__getitem__,
                            bytes_of=lambda adapter, rank: p.adapter_bytes(rank), max_num_seqs=p.max_num_seqs,
                            total_pages=p.pool_pages, tokens_per_s=rate,
                            load_bytes_per_s=0.0 if self.config.mode == LoadMode.CACHED else p.pcie_bytes_per_s,
                            steps=eng.step_times, now=self.clock.now)

    # ---- one engine step ---------------------------------------------------------------------
    def _plan(self, eng: _Engine) -> StepPlan | None:
        """The scheduler's next plan, recorded as a decision (and launched, with overlap)."""
        now = self.clock.now
        plan = eng.sched.schedule()
        for abort in eng.sched.take_aborted():
            rec = self.records[abort.request_id]
            rec.aborted, rec.finish_s = True, now
            self._ended += 1
        if plan is None:
            return None
        if self.config.overlap:
            eng.sched.launch(plan)
        self.decisions.append(Decision(eng.index, plan.step_id, now,
                                       tuple(r.request_id for r in plan.rows if r.start_pos == 0),
                                       tuple(r.request_id for r in plan.rows), plan.merged_adapter))
        return plan

    def _start(self, eng: _Engine) -> None:
        """Start the engine's next step: the one planned ahead, else one planned now; with overlap,
        plan the step after it at once (the daemon sends it while this one runs)."""
        self._states[eng.index] = None
        plan, eng.ahead = eng.ahead, None
        if plan is None:
            plan = self._plan(eng)
        if plan is None:
            return
        self._run(eng, plan)
        if self.config.overlap:
            eng.ahead = self._plan(eng)

    def _run(self, eng: _Engine, plan: StepPlan) -> None:
        now, p, mode = self.clock.now, self.profile, self.config.mode
        for name in plan.evict:
            eng.ready_at.pop(name, None)
        for placement in plan.place:
            rank = self._ranks[placement.name]
            load_s = p.load_s(rank)
            eng.sched.adapters.record_load_ms(placement.name, load_s * 1e3)
            if mode == LoadMode.CACHED:
                continue  # every adapter already sits in GPU memory: ready now, like one not in ready_at
            eng.link_free = max(now, eng.link_free) + load_s
            eng.ready_at[placement.name] = eng.link_free
            self.pcie_bytes += p.adapter_bytes(rank)
        prompt_len = self._prompt_len
        ranks, prefill, decode, tokens, cold_cpu_s, wait_until = [], 0, 0, 0, 0.0, now
        for row in plan.rows:
            n = len(row.token_ids)
            tokens += n
            if row.start_pos >= prompt_len[row.request_id]:
                decode += 1
            else:
                prefill += n
            if row.adapter is None or row.adapter == plan.merged_adapter:
                continue
            rank = self._ranks[row.adapter]
            ranks.append(rank)
            ready = eng.ready_at.get(row.adapter, now)
            if ready > now:
                wait_until = max(wait_until, ready)
                cold_cpu_s += p.cpu_lora_s(n, rank)
        step_s = p.step_ms(ranks, prefill, decode) / 1e3
        if mode == LoadMode.CPU_ASSIST:  # CPU workers compute the cold deltas while the GPU runs the base model
            start, step_s = now, max(step_s, cold_cpu_s)
        else:
            start = wait_until if mode == LoadMode.ON_DEMAND else now
        eng.plan, eng.started, eng.end = plan, now, start + step_s
        eng.busy_s += eng.end - now
        eng.step_times.observe(step_s * 1e3, ranks, tokens - len(plan.rows))  # plan.prefill_tokens, summed once
        eng.tokens += tokens
        self.steps += 1

    def _complete(self, eng: _Engine) -> None:
        plan, now = eng.plan, self.clock.now
        if plan is None:
            return
        eng.plan = None
        self._states[eng.index] = None
        rows = [RowResult(r.request_id, self._sampled(r), None) for r in plan.rows if r.sample]
        for row in rows:
            rec = self.records[row.request_id]
            if rec.first_token_s is None:
                rec.first_token_s = now
        forward_ms = max(1e-6, (eng.end - eng.started) * 1e3)
        # Loads done by now are forgotten (a name missing from ready_at is ready), so this scan
        # covers the loads in flight, not every adapter the engine ever placed.
        for name in [name for name, ready in eng.ready_at.items() if ready <= now]:
            del eng.ready_at[name]
        loading = list(eng.ready_at)
        for seq in eng.sched.apply(plan, StepResult(plan.step_id, rows, forward_ms=forward_ms, loading=loading)):
            rec = self.records[seq.request_id]
            rec.finish_s, rec.output_tokens = now, len(seq.output_ids)
            self._ended += 1


def simulate(events: list[RequestEvent], config: SimConfig, profile: SimProfile | None = None,
             progress: Callable[[float], None] | None = None) -> SimResult:
    """Run `events` through a fresh simulator (`progress`: see Simulator.run)."""
    return Simulator(config, profile).run(events, progress)
