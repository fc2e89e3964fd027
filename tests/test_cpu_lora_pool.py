"""The per-layer CPU protocol end to end without an engine: the test plays the
engine and the cache manager (exchange and store segments, random adapters,
ready/done words) against a real CpuWorkerPool of worker processes, and checks
every out row against a float64 torch reference. Also: a worker killed or
stalled mid-job never hangs the waiting side and is restarted; aborted, stale,
timed-out and invalid jobs fail cleanly; nothing is left in /dev/shm."""
from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import zmq.asyncio

from bench.cpu_lora_loopback import Assignment, ExchangeDriver, HostStore
from loraplex.cpu_lora.pool import CpuWorkerError, CpuWorkerPool, default_worker_cores
from loraplex.ipc.adapter_store import StoreEntry
from loraplex.ipc.errors import ProtocolError
from loraplex.ipc.exchange import ExchangeLayout, exchange_layout, llama_module_shapes
from loraplex.ipc.protocol import CpuJobDone, CpuLoraJob
from loraplex.ipc.shm import list_segments, segment_name
from tests.tolerances import assert_within, reduction_bound

LAYERS = 3
STAGES = range(4)


@pytest.fixture
def no_shm_leftovers() -> Iterator[str]:
    """A unique segment instance; asserts the test left none of its segments in /dev/shm."""
    instance = f"cputest{os.getpid()}{uuid.uuid4().hex[:8]}"
    yield instance
    left = list_segments(f"/lpx-{instance}")
    assert not left, f"segments left behind: {left}"


@pytest.fixture
def runtime_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="lpx-t", dir="/tmp"))  # short: ipc paths are limited to 107 bytes
    yield path
    shutil.rmtree(path, ignore_errors=True)


class Rig:
    """Exchange + store segments with random adapters: the engine's half of the protocol."""

    def __init__(self, instance: str, max_tokens: int = 48, shapes: dict | None = None) -> None:
        self.layout: ExchangeLayout = exchange_layout(segment_name(instance, "exchange"), num_layers=LAYERS,
                                                      module_shapes=shapes or llama_module_shapes(64, 64, 32, 96),
                                                      max_tokens=max_tokens)
        self.ex = ExchangeDriver(self.layout)
        self.store = HostStore(segment_name(instance, "store"), 1 << 21)
        if shapes is not None:
            self.adapters = {}  # the test places its own
            return
        self.adapters = {
            "qv-r8": self.store.add_random("qv-r8", 8, ["q_proj", "v_proj"], self.layout, seed=1),
            "all-r16-bf16": self.store.add_random(
                "all-r16-bf16", 16, list(self.layout.module_names), self.layout, dtype="bfloat16", seed=2),
            "mlp-r4": self.store.add_random("mlp-r4", 4, ["gate_proj", "up_proj", "down_proj"], self.layout, seed=3),
            "ko-r32-fp16": self.store.add_random("ko-r32-fp16", 32, ["k_proj", "o_proj"], self.layout,
                                                 dtype="float16", seed=4),
        }

    def job(self, job_id: int, seq: int, pieces: list[Assignment], layers: list[int] | None = None,
            **kw: object) -> CpuLoraJob:
        return CpuLoraJob(job_id=job_id, seq=seq, exchange=self.layout, store=self.store.name,
                          layers=layers if layers is not None else list(range(LAYERS)),
                          slices=[p.slice() for p in pieces], **kw)

    async def site(self, layer: int, stage: int, seq: int, workers: int, rows: int,
                   timeout_ms: float = 10_000) -> tuple[torch.Tensor, bool]:
        """Post random x rows for (layer, stage), wait for `workers` completions."""
        x = torch.randn(rows, self.layout.in_features(stage))
        base = self.ex.post(layer, stage, seq, x)
        ok = await asyncio.to_thread(self.ex.wait_done, layer, stage, base + workers, timeout_ms)
        return x, ok

    def check(self, layer: int, stage: int, x: torch.Tensor, pieces: list[Assignment]) -> int:
        """Compare the out rows of every targeted module; returns how many (module, slice) pairs."""
        checked = 0
        for module in self.layout.stage_modules(stage):
            for p in pieces:
                if module not in p.entry.module_names:
                    continue
                rows = slice(p.token_start, p.token_start + p.token_count)
                if not p.active(layer):  # back on the GPU path: the worker must not touch its rows
                    assert torch.isnan(self.ex.out[module][rows]).all()
                    continue
                ref = self.store.reference(p.entry, layer, module, x[rows], p.scaling)
                a, bt = self.store.blocks(p.entry, layer, module)  # float32 s·(x Aᵀ) Bᵀ against float64
                magnitude = abs(p.scaling) * (x[rows].double().abs() @ a.double().abs().t()) @ bt.double().abs()
                bound = reduction_bound(magnitude, a.shape[1] + a.shape[0] + 1, torch.float32)
                assert_within(self.ex.out[module][rows], ref, bound, f"{module} layer {layer}: ")
                checked += 1
        return checked

    def close(self) -> None:
        self.ex.close()
        self.store.close()


async def run_step(rig: Rig, seq: int, jobs: dict[int, CpuLoraJob], pool: CpuWorkerPool,
                   rows: int) -> list[CpuJobDone]:
    futures = [await pool.submit(index, job) for index, job in jobs.items()]
    pieces = [Assignment(s.token_start, s.token_count, s.entry, s.scaling, s.cpu_layers) for job in jobs.values()
              for s in job.slices]
    checked = 0
    for layer in range(LAYERS):
        for stage in STAGES:
            # Poison the out rows: stale data from the previous step must not pass.
            for out in rig.ex.out.values():
                out.fill_(float("nan"))
            x, ok = await rig.site(layer, stage, seq, len(jobs), rows)
            assert ok, f"layer {layer} stage {stage}: workers did not finish"
            checked += rig.check(layer, stage, x, pieces)
    assert checked > 0
    return list(await asyncio.gather(*futures))


def run_with_pool(rig: Rig, runtime_dir: Path, workers: int, scenario, *, start: bool = True) -> None:
    """asyncio.run(scenario(pool)) with a pool of `workers` (started unless start=False), then stop
    the pool and close the rig's segments, whatever happened."""
    async def main() -> None:
        ctx = zmq.asyncio.Context()
        pool = CpuWorkerPool(ctx, runtime_dir, num_workers=workers)
        try:
            if start:
                await pool.start()
            await scenario(pool)
        finally:
            await pool.stop()
            ctx.term()

    try:
        asyncio.run(main())
    finally:
        rig.close()


def worker_pids(pool: CpuWorkerPool) -> list[int]:
    return [pid for pid in (pool.pid(i) for i in range(pool.size)) if pid is not None]


def assert_gone(pids: list[int]) -> None:
    for pid in pids:
        assert not Path(f"/proc/{pid}").exists() or Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"


def test_round_trip_two_workers_many_adapters(no_shm_leftovers: str, runtime_dir: Path) -> None:
    rig = Rig(no_shm_leftovers)
    a = rig.adapters

    async def scenario() -> None:
        ctx = zmq.asyncio.Context()
        pool = CpuWorkerPool(ctx, runtime_dir, num_workers=2)
        await pool.start()
        pids = worker_pids(pool)
        try:
            # The workers name their role and sit on their cores.
            for i, pid in enumerate(pids):
                assert Path(f"/proc/{pid}/comm").read_text().strip() == f"loraplex-cpu-{i}"
                assert f"loraplex-cpu-worker-{i}".encode() in Path(f"/proc/{pid}/cmdline").read_bytes()
                assert os.sched_getaffinity(pid) == {pool.cores[i]}

            # Step 1: worker 0 runs two adapters, worker 1 two others (rows split like a plan would).
            step1 = {
                0: rig.job(1, 1, [Assignment(0, 5, a["qv-r8"], 2.0), Assignment(5, 9, a["all-r16-bf16"], 0.5)]),
                1: rig.job(2, 1, [Assignment(14, 11, a["mlp-r4"], 1.0), Assignment(25, 3, a["ko-r32-fp16"], 4.0)]),
            }
            done = await run_step(rig, 1, step1, pool, rows=28)
            assert [d.job_id for d in done] == [1, 2] and [d.index for d in done] == [0, 1]
            assert [d.tokens for d in done] == [14, 14] and all(d.sites == 4 * LAYERS for d in done)
            assert all(d.busy_ms > 0 for d in done)

            # Step 2: one adapter split across both workers (ceil(L/c) = 2), new seq; worker 1
            # also has rows that leave the CPU path after layer 0 (their layer group has loaded).
            half = [Assignment(0, 20, a["all-r16-bf16"], 1.5), Assignment(20, 19, a["all-r16-bf16"], 1.5)]
            early = Assignment(39, 6, a["mlp-r4"], 3.0, cpu_layers=1)
            step2 = {0: rig.job(3, 2, [half[0]]), 1: rig.job(4, 2, [half[1], early])}
            await run_step(rig, 2, step2, pool, rows=45)

            # Calibration runs on a worker, through the same kernel.
            answer = await pool.calibrate(64, [8, 16], tokens=16, repeats=1, index=1)
            assert answer.index == 1 and answer.ranks == [8, 16] and all(t > 0 for t in answer.tokens_per_s)

            # Aborted: the engine moves the control word while the worker waits.
            fut = await pool.submit(0, rig.job(5, 3, [Assignment(0, 4, a["qv-r8"], 1.0)]))
            await asyncio.sleep(0.05)
            rig.ex.abort()
            with pytest.raises(CpuWorkerError) as err:
                await fut
            assert err.value.code == "aborted" and err.value.job_id == 5

            # Stale: a later step already reused the site (ready > seq).
            rig.ex.post(0, 0, 10)
            with pytest.raises(CpuWorkerError, match="stale"):
                await pool.run_job(1, rig.job(6, 9, [Assignment(0, 4, a["qv-r8"], 1.0)]))

            # Timeout: nobody posts; the worker gives up at its own deadline and keeps serving.
            started = time.monotonic()
            with pytest.raises(CpuWorkerError, match="timeout"):
                await pool.run_job(0, rig.job(7, 11, [Assignment(0, 4, a["qv-r8"], 1.0)], start_deadline_ms=200))
            assert time.monotonic() - started < 5

            # Invalid: an entry whose bytes lie outside the store segment.
            far = StoreEntry(**{**{f: getattr(a["qv-r8"], f) for f in StoreEntry.__dataclass_fields__},
                                "offset": 1 << 30})
            with pytest.raises(CpuWorkerError, match="invalid_job"):
                await pool.run_job(1, rig.job(8, 11, [Assignment(0, 4, far, 1.0)]))

            # Both still serve after all of that.
            step3 = {0: rig.job(9, 12, [Assignment(0, 7, a["mlp-r4"], 1.0)]),
                     1: rig.job(10, 12, [Assignment(7, 7, a["qv-r8"], 1.0)])}
            await run_step(rig, 12, step3, pool, rows=14)
            assert all(w["deaths"] == 0 and w["starts"] == 1 for w in pool.describe())

            # Stopping does not wait for a job that waits on a step that never comes.
            fut = await pool.submit(0, rig.job(11, 100, [Assignment(0, 4, a["qv-r8"], 1.0)],
                                               start_deadline_ms=60_000))
            started = time.monotonic()
            await pool.stop()
            assert time.monotonic() - started < 5
            with pytest.raises(CpuWorkerError):
                await fut
        finally:
            await pool.stop()
            ctx.term()
        assert_gone(pids)

    try:
        asyncio.run(scenario())
    finally:
        rig.close()


@pytest.mark.parametrize("gate", [True, False])
def test_fused_projections_round_trip(no_shm_leftovers: str, runtime_dir: Path, gate: bool) -> None:
    """Phi-3's qkv_proj and gate_up_proj (gate=True), GPT-2's MLP without gate: the workers compute
    each fused module's delta whole, into the slot the model's module shapes give it."""
    shapes = {"qkv_proj": (64, 64 + 2 * 32), "o_proj": (64, 64)}
    shapes.update({"gate_up_proj": (64, 2 * 96)} if gate else {"up_proj": (64, 96)})
    rig = Rig(no_shm_leftovers, shapes={**shapes, "down_proj": (96, 64)})
    every = rig.store.add_random("all-r8", 8, list(rig.layout.module_names), rig.layout, dtype="bfloat16", seed=5)
    attn = rig.store.add_random("qkv-r4", 4, ["qkv_proj"], rig.layout, seed=6)

    async def scenario(pool: CpuWorkerPool) -> None:
        step = {0: rig.job(1, 1, [Assignment(0, 9, every, 2.0)]),
                1: rig.job(2, 1, [Assignment(9, 5, attn, 0.5), Assignment(14, 4, every, 1.0, cpu_layers=1)])}
        done = await run_step(rig, 1, step, pool, rows=18)
        assert all(d.sites == 4 * LAYERS for d in done)

    run_with_pool(rig, runtime_dir, 2, scenario)


def test_killed_and_stalled_workers_fail_fast_and_restart(no_shm_leftovers: str, runtime_dir: Path) -> None:
    rig = Rig(no_shm_leftovers)
    a = rig.adapters

    async def scenario() -> None:
        ctx = zmq.asyncio.Context()
        pool = CpuWorkerPool(ctx, runtime_dir, num_workers=2, stall_grace_s=0.3, restart_backoff_s=0.05)
        await pool.start()
        old = worker_pids(pool)
        try:
            jobs = {0: rig.job(1, 1, [Assignment(0, 6, a["qv-r8"], 1.0)]),
                    1: rig.job(2, 1, [Assignment(6, 6, a["all-r16-bf16"], 1.0)])}
            futures = [await pool.submit(i, job) for i, job in jobs.items()]
            for stage in STAGES:  # layer 0 completes on both workers
                x, ok = await rig.site(0, stage, 1, 2, rows=12)
                assert ok
            os.kill(old[1], signal.SIGKILL)  # mid-job
            with pytest.raises(CpuWorkerError) as err:
                await futures[1]
            assert err.value.code == "worker_died" and err.value.job_id == 2
            # The engine side waits with a deadline: it times out instead of hanging.
            started = time.monotonic()
            _, ok = await rig.site(1, 0, 1, 2, rows=12, timeout_ms=300)
            assert not ok and time.monotonic() - started < 3
            rig.ex.abort()  # the engine abandons the step; the surviving worker drops its job
            with pytest.raises(CpuWorkerError, match="aborted"):
                await futures[0]

            await pool.wait_ready(1, timeout_s=30)  # restarted with backoff
            assert pool.pid(1) != old[1] and pool.describe()[1]["deaths"] == 1
            assert pool.describe()[1]["starts"] == 2
            await run_step(rig, 2, {0: rig.job(3, 2, [Assignment(0, 5, a["mlp-r4"], 2.0)]),
                                    1: rig.job(4, 2, [Assignment(5, 5, a["ko-r32-fp16"], 0.5)])}, pool, rows=10)

            # A stalled worker (stopped, holding its job) is killed once the job overruns its budget.
            stalled_pid = pool.pid(0)
            assert stalled_pid is not None
            fut = await pool.submit(0, rig.job(5, 3, [Assignment(0, 4, a["qv-r8"], 1.0)], layers=[0],
                                               deadline_ms=50, start_deadline_ms=100))
            os.kill(stalled_pid, signal.SIGSTOP)
            with pytest.raises(CpuWorkerError, match="worker_stalled"):
                await asyncio.wait_for(fut, 10)
            await pool.wait_ready(0, timeout_s=30)
            assert pool.pid(0) != stalled_pid and pool.describe()[0]["stalls"] == 1
            await run_step(rig, 4, {0: rig.job(6, 4, [Assignment(0, 3, a["qv-r8"], 1.0)]),
                                    1: rig.job(7, 4, [Assignment(3, 3, a["mlp-r4"], 1.0)])}, pool, rows=6)
            kinds = [kind for _, kind, _, _ in pool.events]
            assert kinds.count("restarted") == 2 and "stalled" in kinds
        finally:
            await pool.stop()
            ctx.term()
        assert_gone(old + worker_pids(pool))

    try:
        asyncio.run(scenario())
    finally:
        rig.close()


def test_submit_to_a_stopped_pool_is_unavailable(runtime_dir: Path, no_shm_leftovers: str) -> None:
    rig = Rig(no_shm_leftovers)

    async def scenario(pool: CpuWorkerPool) -> None:
        with pytest.raises(CpuWorkerError, match="unavailable"):
            await pool.submit(0, rig.job(1, 1, [Assignment(0, 1, rig.adapters["qv-r8"], 1.0)]))

    run_with_pool(rig, runtime_dir, 1, scenario, start=False)


def test_pool_and_calibration_import_without_torch() -> None:
    code = ("import sys; import loraplex.cpu_lora.pool, loraplex.cpu_lora.calibration, loraplex.cpu_lora.process;"
            "import loraplex.ipc.protocol; assert 'torch' not in sys.modules, 'torch was imported'")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr


def test_default_cores_leave_room_for_daemon_and_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    assert default_worker_cores() == [2, 3, 4, 5, 6, 7]
    assert default_worker_cores(reserved_cores=[0]) == [1, 2, 3, 4, 5, 6, 7]
    assert default_worker_cores(3) == [2, 3, 4]
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    assert default_worker_cores() == [0, 1]  # too few cores to reserve any; still at least two workers
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {5})
    assert default_worker_cores() == [5, 5]
    with pytest.raises(ValueError):
        CpuWorkerPool(None, "/tmp", num_workers=3, cores=[0, 1])  # type: ignore[arg-type]


def test_job_validation(no_shm_leftovers: str) -> None:
    layout = exchange_layout(segment_name(no_shm_leftovers, "exchange"), 2, llama_module_shapes(64, 64, 32, 96), 16)
    from loraplex.ipc.adapter_store import store_entry_layout
    from loraplex.ipc.codec import decode, encode
    from loraplex.ipc.protocol import CpuJobSlice

    entry = store_entry_layout("a", 8, {"q_proj": (64, 64)}, 2, "float32").at(0)
    good = CpuLoraJob(job_id=1, seq=1, exchange=layout, store="/lpx-x-store", layers=[0, 1],
                      slices=[CpuJobSlice(0, 8, entry, 1.0), CpuJobSlice(8, 8, entry, 1.0)])
    assert decode(encode(good)) == good and good.tokens == 16
    bad_cases = [
        {"layers": [1, 0]},
        {"layers": [0, 2]},
        {"layers": []},
        {"seq": 0},
        {"store": "no-slash"},
        {"deadline_ms": 0},
        {"slices": [CpuJobSlice(0, 8, entry, 1.0), CpuJobSlice(7, 2, entry, 1.0)]},  # overlap
        {"slices": [CpuJobSlice(10, 7, entry, 1.0)]},  # past max_tokens
        {"slices": [CpuJobSlice(0, 1, store_entry_layout("a", 8, {"q_proj": (64, 32)}, 2, "float32").at(0), 1.0)]},
        {"slices": [CpuJobSlice(0, 1, store_entry_layout("a", 8, {"q_proj": (64, 64)}, 3, "float32").at(0), 1.0)]},
        # a module this model has no slot for (Llama's exchange, a fused qkv_proj)
        {"slices": [CpuJobSlice(0, 1, store_entry_layout("a", 8, {"qkv_proj": (64, 128)}, 2, "float32").at(0), 1.0)]},
    ]
    fields = {f: getattr(good, f) for f in good.__dataclass_fields__}
    for change in bad_cases:
        with pytest.raises(ProtocolError):
            CpuLoraJob(**{**fields, **change})
    with pytest.raises(ValueError, match="not placed"):
        CpuJobSlice(0, 1, store_entry_layout("a", 8, {"q_proj": (64, 64)}, 2, "float32"), 1.0)
