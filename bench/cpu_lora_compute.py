"""CPU LoRA compute (Toppings Fig. 17): what one core does, and N worker
processes against one process with N torch threads on the same cores.

Part 1 (`per_core`): tokens/s through one hidden x hidden LoRA module on one
pinned core with the workers' single-thread kernel, per rank and prompt length.
Part 2 (`parallel`): one step of CPU-assisted prefill over `--layers` layers of
a Llama-shaped model (all seven projections targeted), run (a) by the real
CpuWorkerPool — N worker processes, one thread each, rows split evenly, driven
through the exchange segment's ready/done words exactly as the engine drives
them — and (b) by this process with torch.set_num_threads(N) on the same N
cores computing the same deltas from the same store views. `ratio` is
(b) / (a) time; the paper's claim is >= 1.4x.

Stdout: a table, or with --json one JSON object; progress on stderr.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import torch
import zmq.asyncio

from loraplex.cpu_lora.calibration import cpu_model_name, split_rows
from loraplex.cpu_lora.compute import lora_delta
from loraplex.cpu_lora.pool import CpuWorkerPool
from loraplex.ipc.adapter_store import store_entry_layout
from loraplex.ipc.exchange import STAGES, exchange_layout, llama_module_shapes
from loraplex.ipc.protocol import CpuJobDone, CpuLoraJob
from loraplex.ipc.shm import segment_name

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: the repository root
from bench.cpu_lora_loopback import Assignment, ExchangeDriver, HostStore  # noqa: E402

TARGET_RATIO = 1.4
SEGMENT_INSTANCE_PREFIX = "cpubench"  # segments are /lpx-cpubench<pid><random>-{exchange,store}


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def median_ms(fn: Any, repeats: int) -> tuple[float, list[float]]:
    fn()  # warm-up
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        runs.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(runs), runs


# -- part 1 ------------------------------------------------------------------------


def per_core(hidden: int, ranks: list[int], lens: list[int], repeats: int, core: int) -> list[dict[str, Any]]:
    before_threads, before_cores = torch.get_num_threads(), os.sched_getaffinity(0)
    os.sched_setaffinity(0, {core})
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    out_rows = []
    try:
        x_all = torch.randn(max(lens), hidden, generator=gen)
        out_all = torch.empty(max(lens), hidden)
        for rank in ranks:
            a = torch.randn(rank, hidden, generator=gen) / math.sqrt(hidden)
            bt = torch.randn(rank, hidden, generator=gen) / math.sqrt(rank)
            for length in lens:
                x, out = x_all[:length], out_all[:length]
                ms, _ = median_ms(lambda: lora_delta(x, a, bt, 2.0, out), repeats)
                out_rows.append({"rank": rank, "prompt_len": length, "ms_median": ms,
                                 "tokens_per_s": length / (ms / 1e3)})
                log(f"per-core rank {rank:4d} len {length:5d}: {length / (ms / 1e3):12.0f} tok/s")
    finally:
        torch.set_num_threads(before_threads)
        os.sched_setaffinity(0, before_cores)
    return out_rows


# -- part 2 ------------------------------------------------------------------------


class ParallelRig:
    """Exchange + store for one Llama-shaped model; one adapter per rank, all seven modules."""

    def __init__(self, hidden: int, intermediate: int, layers: int, max_tokens: int, ranks: list[int]) -> None:
        instance = f"{SEGMENT_INSTANCE_PREFIX}{os.getpid()}{uuid.uuid4().hex[:6]}"
        shapes = llama_module_shapes(hidden, hidden, hidden, intermediate)
        self.layout = exchange_layout(segment_name(instance, "exchange"), layers, shapes, max_tokens)
        need = sum(store_entry_layout(f"r{r}", r, shapes, layers, "float32").nbytes + 4096 for r in ranks)
        self.ex = ExchangeDriver(self.layout)
        self.store = HostStore(segment_name(instance, "store"), need)
        try:
            self.adapters = {r: self.store.add_random(f"r{r}", r, list(shapes), self.layout, seed=r) for r in ranks}
            gen = torch.Generator().manual_seed(1)
            for x in self.ex.x:  # x stays fixed; each post only moves the ready word
                x.copy_(torch.randn(x.shape, generator=gen))
        except BaseException:
            self.close()
            raise

    def threads_step(self, rank: int, tokens: int) -> None:
        entry = self.adapters[rank]
        for layer in range(self.layout.num_layers):
            for stage in range(len(STAGES)):
                x = self.ex.x[stage][:tokens]
                for module in self.layout.stage_modules(stage):
                    a, bt = self.store.blocks(entry, layer, module)
                    lora_delta(x, a, bt, 2.0, self.ex.out[module][:tokens])

    def max_error(self, rank: int, tokens: int) -> float:
        """Out rows (last layer's deltas) against float64, after a step."""
        layer = self.layout.num_layers - 1
        err = 0.0
        for stage in range(len(STAGES)):
            x = self.ex.x[stage][:tokens]
            for module in self.layout.stage_modules(stage):
                ref = self.store.reference(self.adapters[rank], layer, module, x, 2.0)
                scale = max(1.0, ref.abs().max().item())
                err = max(err, (self.ex.out[module][:tokens].double() - ref).abs().max().item() / scale)
        return err

    def close(self) -> None:
        self.ex.close()
        self.store.close()


async def multiproc_step(pool: CpuWorkerPool, rig: ParallelRig, seq: int, rank: int,
                         tokens: int) -> tuple[float, float]:
    """(step ms as the engine sees it, jobs sent to last done; mean worker busy ms)."""
    layout, workers = rig.layout, pool.size
    splits = split_rows(tokens, workers)
    t0 = time.perf_counter()
    futures = []
    for index, (start, count) in enumerate(splits):
        job = CpuLoraJob(job_id=seq * 1000 + index, seq=seq, exchange=layout, store=rig.store.name,
                         layers=list(range(layout.num_layers)),
                         slices=[Assignment(start, count, rig.adapters[rank], 2.0).slice()])
        futures.append(await pool.submit(index, job))
    for layer in range(layout.num_layers):
        for stage in range(len(STAGES)):
            base = rig.ex.post(layer, stage, seq)
            if not rig.ex.wait_done(layer, stage, base + len(splits), 60_000):
                raise RuntimeError(f"workers missed layer {layer} stage {stage}")
    elapsed = (time.perf_counter() - t0) * 1e3
    done: list[CpuJobDone] = list(await asyncio.gather(*futures))
    return elapsed, statistics.mean(d.busy_ms for d in done)


async def parallel(args: argparse.Namespace, cores: list[int]) -> list[dict[str, Any]]:
    """Both arms per (rank, length), interleaved run by run so they see the same host load."""
    rig = ParallelRig(args.hidden, args.intermediate, args.layers, max(args.parallel_lens), args.parallel_ranks)
    ctx = zmq.asyncio.Context()
    runtime_dir = Path(tempfile.mkdtemp(prefix="lpx-b", dir="/tmp"))
    pool = CpuWorkerPool(ctx, runtime_dir, cores=cores)
    before_threads, before_cores = torch.get_num_threads(), os.sched_getaffinity(0)
    results = []
    seq = 0
    try:
        await pool.start()
        # The threads arm: this process on the same cores, one intra-op thread per core (while the
        # workers run, this process only waits on done words).
        os.sched_setaffinity(0, set(cores))
        torch.set_num_threads(len(cores))
        for rank in args.parallel_ranks:
            for tokens in args.parallel_lens:
                seq += 1
                await multiproc_step(pool, rig, seq, rank, tokens)  # warm-up both
                rig.threads_step(rank, tokens)
                mp_runs, th_runs, busy = [], [], []
                for _ in range(args.repeats):
                    seq += 1
                    ms, busy_ms = await multiproc_step(pool, rig, seq, rank, tokens)
                    mp_runs.append(ms)
                    busy.append(busy_ms)
                    t0 = time.perf_counter()
                    rig.threads_step(rank, tokens)
                    th_runs.append((time.perf_counter() - t0) * 1e3)
                th_err = rig.max_error(rank, tokens)
                for out in rig.ex.out.values():
                    out.zero_()
                seq += 1
                await multiproc_step(pool, rig, seq, rank, tokens)
                mp_err = rig.max_error(rank, tokens)
                mp_ms, th_ms = statistics.median(mp_runs), statistics.median(th_runs)
                row = {"rank": rank, "prompt_len": tokens, "workers": len(cores), "layers": args.layers,
                       "multiproc_ms": mp_ms, "threads_ms": th_ms, "ratio": th_ms / mp_ms,
                       "ratio_best": min(th_runs) / min(mp_runs),
                       "multiproc_worker_busy_ms": statistics.median(busy),
                       "multiproc_tokens_per_s": tokens * args.layers / (mp_ms / 1e3),
                       "threads_tokens_per_s": tokens * args.layers / (th_ms / 1e3),
                       "multiproc_runs_ms": mp_runs, "threads_runs_ms": th_runs,
                       "max_rel_err": max(mp_err, th_err)}
                results.append(row)
                log(f"parallel rank {rank:4d} len {tokens:5d}: {len(cores)} procs {mp_ms:8.2f} ms, "
                    f"{len(cores)} threads {th_ms:8.2f} ms, ratio {th_ms / mp_ms:.2f} (best {row['ratio_best']:.2f})")
    finally:
        torch.set_num_threads(before_threads)
        os.sched_setaffinity(0, before_cores)
        await pool.stop()
        ctx.term()
        rig.close()
        runtime_dir.rmdir()
    return results


# -- main --------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--small", action="store_true", help="tiny sizes (tests, smoke runs)")
    p.add_argument("--hidden", type=int)
    p.add_argument("--intermediate", type=int, help="default: Llama-2 ratio, 11008/4096 of hidden")
    p.add_argument("--ranks", type=int, nargs="+", help="per-core ranks")
    p.add_argument("--prompt-lens", type=int, nargs="+", help="per-core prompt lengths")
    p.add_argument("--parallel-ranks", type=int, nargs="+")
    p.add_argument("--parallel-lens", type=int, nargs="+")
    p.add_argument("--layers", type=int, help="layers per parallel step")
    p.add_argument("--workers", type=int, help="processes = threads; default: every allowed core")
    p.add_argument("--repeats", type=int)
    args = p.parse_args(argv)
    small = args.small
    defaults = {
        "hidden": 256 if small else 4096,
        "ranks": [8, 16] if small else [8, 16, 32, 64, 128],
        "prompt_lens": [16, 64] if small else [64, 128, 256, 512, 1024],
        "parallel_ranks": [8] if small else [16, 64],
        "parallel_lens": [32] if small else [256, 1024],
        "layers": 2,
        "repeats": 2 if small else 5,
    }
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.intermediate is None:
        args.intermediate = args.hidden * 11008 // 4096
    allowed = sorted(os.sched_getaffinity(0))
    args.workers = args.workers or max(2, len(allowed))
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    allowed = sorted(os.sched_getaffinity(0))
    cores = [allowed[i % len(allowed)] for i in range(args.workers)]
    load_start = os.getloadavg()[0]
    log(f"per-core: hidden {args.hidden}, ranks {args.ranks}, lengths {args.prompt_lens}, core {cores[0]}")
    core_rows = per_core(args.hidden, args.ranks, args.prompt_lens, args.repeats, cores[0])
    log(f"parallel: {args.workers} workers on cores {cores}, {args.layers} layers, hidden {args.hidden}, "
        f"intermediate {args.intermediate}")
    par_rows = asyncio.run(parallel(args, cores))
    ratios = [r["ratio"] for r in par_rows]
    report = {
        "benchmark": "cpu_lora_compute",
        "env": {"torch": torch.__version__, "device": "cpu", "device_name": cpu_model_name(),
                "cpu_count": os.cpu_count(), "allowed_cores": len(allowed),
                "loadavg_1m": [load_start, os.getloadavg()[0]]},
        "config": {"hidden": args.hidden, "intermediate": args.intermediate, "ranks": args.ranks,
                   "prompt_lens": args.prompt_lens, "parallel_ranks": args.parallel_ranks,
                   "parallel_lens": args.parallel_lens, "layers": args.layers, "workers": args.workers,
                   "cores": cores, "repeats": args.repeats, "dtype": "float32",
                   "modules": list(llama_module_shapes(1, 1, 1, 1)), "small": args.small},
        "per_core": core_rows,
        "parallel": par_rows,
        "summary": {"ratio_min": min(ratios), "ratio_max": max(ratios),
                    "ratio_best_min": min(r["ratio_best"] for r in par_rows),
                    "ratio_geomean": math.exp(statistics.mean(math.log(r) for r in ratios)),
                    "target_ratio": TARGET_RATIO},
    }
    if args.json:
        print(json.dumps(report))
        return 0
    env = report["env"]
    load = env["loadavg_1m"]
    print(f"{env['device_name']}  torch {env['torch']}  cores {cores}  load {load[0]:.2f}->{load[1]:.2f}")
    print(f"{'rank':>5} {'len':>6} {'tok/s per core':>15}")
    for row in core_rows:
        print(f"{row['rank']:>5} {row['prompt_len']:>6} {row['tokens_per_s']:>15.0f}")
    print(f"{'rank':>5} {'len':>6} {'procs ms':>10} {'threads ms':>11} {'ratio':>6}")
    for row in par_rows:
        print(f"{row['rank']:>5} {row['prompt_len']:>6} {row['multiproc_ms']:>10.2f} {row['threads_ms']:>11.2f} "
              f"{row['ratio']:>6.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
