"""The daemon's CPU-assist driver: turns the planner's worker slices into jobs
for the CPU worker pool, keeps the cost model up to date, and reports the
pool's health.

Torch-free. Jobs are submitted before the engine step that needs them (the
workers wait on the exchange's ready words); their completions are collected
in the background, so a slow or dead worker never blocks the iteration loop —
the engine's per-site deadline and the pool's supervision handle it.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import time

from loraplex.cpu_lora.calibration import CpuProfile
from loraplex.cpu_lora.pool import CpuWorkerError, CpuWorkerPool
from loraplex.daemon.adapter_table import AdapterTable
from loraplex.daemon.cpu_planner import CpuCosts, plan_cpu_assist
from loraplex.ipc.engine_plan import StepPlan, StepResult
from loraplex.ipc.protocol import CpuJobSlice, CpuLoraJob, EngineHello

log = logging.getLogger("loraplex.daemon.cpu")
REAP_GRACE_S = 0.5


class CpuAssistDriver:
    def __init__(self, pool: CpuWorkerPool, hello: EngineHello, profile: CpuProfile, load_groups: int) -> None:
        if hello.exchange is None or not hello.store_segment:
            raise ValueError("the engine did not create a host store and exchange (not in cpu_assist mode)")
        self.pool = pool
        self.load_groups = load_groups
        self.profile = profile
        self.costs = CpuCosts(num_layers=hello.num_layers, link_bytes_per_s=hello.link_bytes_per_s,
                              cpu_tokens_per_s={r: t for r, t in zip(profile.ranks, profile.tokens_per_s)})
        self.set_engine(hello)
        self._job_ids = itertools.count(1)
        self._seq = itertools.count(1)
        self.jobs = self.failures = self.cpu_rows = self.submit_failures = 0
        self.busy_ms = 0.0
        self._pending: set[asyncio.Future] = set()
        self._started = time.monotonic()
        self._per_worker: dict[int, list[float]] = {}  # worker -> [busy ms, tokens]
        self._step_jobs: dict[int, list[tuple[int, int, asyncio.Future]]] = {}  # seq -> (worker, job id, future)

    def set_engine(self, hello: EngineHello) -> None:
        """A (re)started engine: new exchange and store, sequence words start from zero again."""
        self.exchange = hello.exchange
        self.store = hello.store_segment
        self.costs.link_bytes_per_s = hello.link_bytes_per_s
        self._seq = itertools.count(1)

    async def prepare(self, plan: StepPlan, adapters: AdapterTable) -> StepPlan:
        """Give this step's cold-adapter prefill rows CPU layers and submit their jobs."""
        ready = [i for i in range(self.pool.size) if self.pool.is_ready(i)]
        info = {}
        for p in plan.place:
            entry = adapters.get(p.name)
            if entry is not None and entry.store_entry is not None:
                info[p.name] = (entry.nbytes, entry.rank)
        if not info or not ready:
            return plan
        planned = plan_cpu_assist(plan, seq=next(self._seq),
                                  costs=self.costs, workers=ready, exchange_rows=self.exchange.max_tokens,
                                  adapter_info=info, load_groups=self.load_groups)
        if planned.plan.cpu is None:
            return plan
        for worker, slices in planned.slices.items():
            job_slices = []
            for s in slices:
                entry = adapters.get(s.adapter)
                job_slices.append(CpuJobSlice(token_start=s.xrow, token_count=s.count, entry=entry.store_entry,
                                              scaling=entry.scaling, cpu_layers=s.cpu_layers))
            layers = list(range(max(s.cpu_layers for s in slices)))
            job = CpuLoraJob(job_id=next(self._job_ids), seq=planned.plan.cpu.seq, exchange=self.exchange,
                             store=self.store, layers=layers, slices=job_slices)
            try:
                future = await self.pool.submit(worker, job)
            except CpuWorkerError as exc:  # died since `ready` was read: the engine's deadline covers its rows
                log.warning("cpu worker %d lost before its job was sent (%s); the GPU computes its rows", worker, exc)
                self.submit_failures += 1
                continue
            self._track(future)
            self._step_jobs.setdefault(job.seq, []).append((worker, job.job_id, future))
            self.jobs += 1
        while len(self._step_jobs) > 64:  # steps whose result never came back (engine failure)
            self._step_jobs.pop(next(iter(self._step_jobs)))
        self.cpu_rows += sum(1 for r in planned.plan.rows if r.cpu_layers)
        return planned.plan

    def _track(self, future: asyncio.Future) -> None:
        self._pending.add(future)

        def done(f: asyncio.Future) -> None:
            self._pending.discard(f)
            if f.cancelled():
                return
            exc = f.exception()
            if exc is not None:
                self.failures += 1
                level = logging.WARNING if isinstance(exc, CpuWorkerError) else logging.ERROR
                log.log(level, "CPU LoRA job failed: %s", exc)
            else:
                done_msg = f.result()
                self.busy_ms += done_msg.busy_ms
                acc = self._per_worker.setdefault(done_msg.index, [0.0, 0.0])
                acc[0] += done_msg.busy_ms
                acc[1] += done_msg.tokens

        future.add_done_callback(done)

    def observe(self, plan: StepPlan, result: StepResult) -> None:
        self.costs.observe_step(result.forward_ms, plan.num_tokens)
        if plan.cpu is None:
            return
        jobs = self._step_jobs.pop(plan.cpu.seq, [])
        if result.cpu_timeouts and jobs:
            # Healthy workers answer right after their last site; whoever is still silent shortly
            # after the engine gave up is stalled (or dead) and is replaced now.
            asyncio.get_running_loop().call_later(REAP_GRACE_S, self._reap, jobs)

    def _reap(self, jobs: list[tuple[int, int, asyncio.Future]]) -> None:
        for worker, job_id, future in jobs:
            if not future.done() and self.pool.declare_stalled(worker, job_id):
                log.warning("CPU worker %d missed the engine's deadline; restarting it", worker)

    def workers(self) -> list[dict[str, object]]:
        """Per worker: busy % since the pool started, tokens done, restarts (for the console)."""
        elapsed_ms = max(1.0, (time.monotonic() - self._started) * 1e3)
        rows = []
        for w in self.pool.describe():
            busy, tokens = self._per_worker.get(w["index"], [0.0, 0.0])
            rows.append({**w, "busy_pct": 100.0 * busy / elapsed_ms, "tokens": int(tokens),
                         "restarts": max(0, int(w.get("starts", 1)) - 1)})
        return rows

    def snapshot(self) -> dict[str, object]:
        return {"jobs": self.jobs, "failures": self.failures, "submit_failures": self.submit_failures,
                "cpu_rows": self.cpu_rows, "busy_ms": self.busy_ms,
                "layer_ms_per_token": self.costs.layer_ms_per_token,
                "link_mb_s": self.costs.link_bytes_per_s / 1e6, "workers": self.pool.describe()}
