"""Test support: CPU-assisted prefill on a tensor-parallel engine below the daemon. Rank 0
owns the engine's CpuAssistResources (exchange + host store, as gpu_engine/engine_process.py
builds them) and a real CpuWorkerPool, run on an event loop in a thread of its own; the test
plays the daemon's CPU planner: it gives each adapter row of a prefill step CPU layers and
exchange rows, and hands the workers their jobs before the step (they wait on ready words)."""
from __future__ import annotations

import asyncio
import dataclasses
import itertools
import tempfile
import threading
from concurrent.futures import Future
from pathlib import Path

from loraplex.cpu_lora.pool import CpuWorkerPool
from loraplex.ipc.engine_plan import CpuAssistStep, RowPlan
from loraplex.ipc.protocol import CpuJobSlice, CpuLoraJob, EngineAdapterLoaded

WORKERS = 2


class AssistRig:
    """The CPU workers and the planning the daemon does for them (gpu_engine side: `resources`)."""

    def __init__(self, resources, num_layers: int) -> None:
        self.resources = resources
        self.num_layers = num_layers
        self.loaded: dict[str, EngineAdapterLoaded] = {}
        self.seq = itertools.count(1)
        self.job_ids = itertools.count(1)
        self._dir = tempfile.TemporaryDirectory(prefix="lpx-tpa", dir="/tmp")  # short: socket paths are limited
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="cpu-pool-loop", daemon=True)
        self._thread.start()
        self.pool: CpuWorkerPool = self._call(self._start())
        self._pending: list[Future] = []

    def _call(self, coro, timeout_s: float = 60.0):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout_s)

    async def _start(self) -> CpuWorkerPool:
        import zmq.asyncio

        self._ctx = zmq.asyncio.Context()
        pool = CpuWorkerPool(self._ctx, Path(self._dir.name), num_workers=WORKERS)
        await pool.start()
        return pool

    def plan(self, rows: list[RowPlan], stalled: bool = False) -> tuple[list[RowPlan], CpuAssistStep]:
        """Every adapter row runs its first 1 or all layers on the CPU (alternately), its tokens in consecutive
        exchange rows; worker i takes every WORKERS-th CPU row. Submits the jobs (none when `stalled`: the
        first site times out and rank 0 computes the step's CPU rows itself); returns the rows and the step."""
        planned, slices, xrow = [], [[] for _ in range(WORKERS)], 0
        cpu_count = 0
        for row in rows:
            if row.adapter is None:
                planned.append(row)
                continue
            layers = self.num_layers if cpu_count % 2 == 0 else 1
            loaded = self.loaded[row.adapter]
            slices[cpu_count % WORKERS].append(CpuJobSlice(token_start=xrow, token_count=len(row.token_ids),
                                                           entry=loaded.store_entry, scaling=loaded.scaling,
                                                           cpu_layers=layers))
            planned.append(dataclasses.replace(row, cpu_layers=layers, cpu_row=xrow))
            xrow += len(row.token_ids)
            cpu_count += 1
        if any(not s for s in slices):
            raise ValueError(f"the case needs at least {WORKERS} adapter rows")
        seq = next(self.seq)
        layout = self.resources.assist.layout
        for index, own in enumerate([] if stalled else slices):
            job = CpuLoraJob(job_id=next(self.job_ids), seq=seq, exchange=layout, store=self.resources.store.name,
                             layers=list(range(self.num_layers)), slices=own)
            self._pending.append(asyncio.run_coroutine_threadsafe(self._run_job(index, job), self._loop))
        return planned, CpuAssistStep(seq=seq, workers_per_layer=[WORKERS] * self.num_layers, exchange_rows=xrow)

    async def _run_job(self, index: int, job: CpuLoraJob):
        return await (await self.pool.submit(index, job))

    def finish_step(self) -> None:
        """Every job of the step completed on its worker (a failed one raises CpuWorkerError here)."""
        for future in self._pending:
            future.result(60)
        self._pending = []

    def close(self) -> None:
        try:
            self._call(self.pool.stop())
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
            self._ctx.term()
            self._loop.close()
            self._dir.cleanup()
