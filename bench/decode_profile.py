"""Decode-step profile of the engine: the cost of unmerged LoRA in a decode step.

Measures (Toppings §5):
- decode step time of the base model vs the same batch spread over 64 distinct
  adapters (the overhead of serving many adapters at once);
- decode step times over batch sizes and rank mixes, fitted to
  PERF_BGMV = α·|S|·max_rank + β and PERF_MBGMV = α·Σrank + β (least squares,
  with R²), written with `--profile-out` as the PerfProfile file that the
  rank_aware router reads (`scheduler.router_profile`).

`--shape 7b` is a Llama-2-7B-shaped model with random weights built on the
device (nothing is read from disk); `--shape tiny` runs anywhere in seconds and
only checks the script. With the Triton backend the BGMV samples are taken with
the BGMV kernel forced and the MBGMV samples with MBGMV; with the torch backend
both models are fitted to the same samples. `--cuda-graphs on` replays decode
steps as CUDA graphs (CUDA with the Triton backend; elsewhere it stays eager), so
`on` and `off` runs time the same steps side by side; graphs always replay the
MBGMV kernel, so under `on` the BGMV samples are MBGMV replays too. Prints a
table, or one JSON object with `--json`; progress goes to stderr.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from model_shapes import add_model_args, resolve_model_args, shape_config

from loraplex.contracts.geometry import PageGeometry
from loraplex.daemon.memory.allocator import PageAllocator
from loraplex.daemon.scheduler.fcfs import FcfsScheduler, SchedulerConfig
from loraplex.daemon.scheduler.sequence import SeqRequest
from loraplex.gpu_engine.executor import Executor
from loraplex.gpu_engine.lora.peft_adapter import AdapterSpec, HostAdapter
from loraplex.gpu_engine.model.config import ModelConfig
from loraplex.gpu_engine.model.weights import random_weights
from loraplex.ipc.engine_plan import SamplingSpec, StepPlan

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(p)
    p.add_argument("--backend", choices=("torch", "triton"), default=None,
                   help="LoRA backend (default: triton on cuda, torch on cpu)")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 16, 32, 64])
    p.add_argument("--ranks", type=int, nargs="+", default=[8, 16, 32, 64, 128])
    p.add_argument("--distinct", type=int, default=64, help="distinct adapters in the overhead measurement")
    p.add_argument("--overhead-rank", type=int, default=16, help="their rank")
    p.add_argument("--fit-distinct", type=int, default=8, help="distinct adapters per rank in the fitted steps")
    p.add_argument("--context", type=int, default=128, help="prompt tokens per sequence")
    p.add_argument("--steps", type=int, default=5, help="timed decode steps per configuration")
    p.add_argument("--cuda-graphs", choices=("on", "off"), default="off",
                   help="replay decode steps as CUDA graphs (CUDA + triton backend only; eager elsewhere)")
    p.add_argument("--profile-out", type=Path, default=None, help="write the fitted PerfProfile JSON here")
    p.add_argument("--no-fit", action="store_true", help="only the base vs many-adapter overhead, no fitted models")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    resolve_model_args(args)
    args.backend = args.backend or ("triton" if args.device.startswith("cuda") else "torch")
    return args


def log(message: str) -> None:
    print(f"decode_profile: {message}", file=sys.stderr, flush=True)


def fit_line(xs: list[float], ys: list[float]) -> dict[str, float]:
    """Least-squares y = alpha·x + beta, with R² (1.0 when y has no variance left to explain)."""
    n = len(xs)
    if n < 2 or len(set(xs)) < 2:
        raise ValueError("a fit needs at least two distinct x values")
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    alpha = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    beta = my - alpha * mx
    ss_tot = sum((y - my) ** 2 for y in ys)
    ss_res = sum((y - (alpha * x + beta)) ** 2 for x, y in zip(xs, ys))
    return {"alpha": alpha, "beta": beta, "r2": 1.0 - ss_res / ss_tot if ss_tot > 0 else 1.0}


def bgmv_x(ranks: list[int]) -> float:
    return len(ranks) * max(ranks, default=0)


def mbgmv_x(ranks: list[int]) -> float:
    return float(sum(ranks))


class Engine:
    """A random model of the chosen shape on the device, driven the way the daemon drives an engine:
    a torch-free FCFS scheduler plans each step, the executor runs it."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.device, self.dtype = resolve_model_args(args)
        self.cfg = ModelConfig.from_hf(shape_config(args.shape))
        torch.manual_seed(0)
        weights = random_weights(self.cfg, device=self.device, dtype=self.dtype)
        shapes = self.cfg.module_shapes()
        self.geometry = PageGeometry.for_model(shapes, self.cfg.kv_dim, None)
        # Adapters: `distinct` of the overhead rank, and `fit_distinct` per rank for the fits.
        self.overhead_names = [f"o{i}" for i in range(args.distinct)]
        self.by_rank = {} if args.no_fit else {r: [f"r{r}-{i}" for i in range(args.fit_distinct)] for r in args.ranks}
        specs = [(n, args.overhead_rank) for n in self.overhead_names] + \
            [(n, r) for r, names in self.by_rank.items() for n in names]
        kv_pages = max(args.batches) * self.geometry.kv_pages_for(args.context + args.steps + 8)
        self.executor = Executor(self.cfg, weights, self.geometry, 1, device=torch.device("cpu"),
                                 dtype=self.dtype, lora_backend="torch")  # pool sized below, once layouts are known
        adapter_pages = sum(self.executor.add_host_adapter(self._adapter(n, r)).num_pages for n, r in specs)
        self.num_pages = kv_pages + adapter_pages  # every adapter can stay resident: no eviction mid-run
        host = self.executor.host
        self.executor = Executor(self.cfg, weights, self.geometry, self.num_pages, device=self.device,
                                 dtype=self.dtype, lora_backend=args.backend)
        self.executor.host.update(host)
        self.graphs = self.executor.setup_decode_graphs(
            max_batch=max(args.batches), max_model_len=args.context + args.steps + 8,
            max_lora_rank=max([*args.ranks, args.overhead_rank]), enabled=args.cuda_graphs == "on")
        self._steps = 0

    def _adapter(self, name: str, rank: int) -> HostAdapter:
        shapes = self.cfg.module_shapes()
        a = [{m: torch.randn(rank, shapes[m][0]).to(self.dtype) * shapes[m][0] ** -0.5 for m in TARGETS}
             for _ in range(self.cfg.num_layers)]
        b = [{m: (torch.randn(shapes[m][1], rank) * 0.01).to(self.dtype) for m in TARGETS}
             for _ in range(self.cfg.num_layers)]
        return HostAdapter(name=name, path=Path("/random"), spec=AdapterSpec(rank, 2 * rank, False, TARGETS), a=a, b=b)

    def decode_ms(self, adapters: list[str | None]) -> float:
        """Median time of a decode step of len(adapters) sequences (an adapter name or None each)."""
        allocator = PageAllocator(self.num_pages)
        sched = FcfsScheduler(SchedulerConfig(max_num_seqs=len(adapters), max_batched_tokens=65536,
                                              max_model_len=self.args.context + self.args.steps + 8,
                                              max_loras_per_batch=0, admit_when_loaded=False),
                              self.geometry, allocator, lambda n: self.executor.host[n].layout.num_pages, ())
        for i, name in enumerate(adapters):
            prompt = torch.randint(3, self.cfg.vocab_size, (self.args.context,)).tolist()
            sched.add(SeqRequest(request_id=f"s{i}", prompt_ids=prompt, adapter=name,
                                 sampling=SamplingSpec(temperature=0.0, top_p=1.0, top_k=1, seed=i),
                                 max_tokens=self.args.steps + 2, ignore_eos=True))
        times: list[float] = []
        while sched.has_work():
            plan = sched.schedule()
            decode = len(plan.rows) == len(adapters) and all(len(r.token_ids) == 1 for r in plan.rows)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            started = time.perf_counter()
            result = self.executor.execute(plan)  # sampling brings tokens to the host: the step has finished
            if decode and not plan.place:
                times.append((time.perf_counter() - started) * 1e3)
            sched.apply(plan, result)
        self._steps += 1  # the next run starts from an empty pool: drop this run's adapter copies
        self.executor.execute(StepPlan(step_id=-self._steps, rows=[], evict=sorted(self.executor.resident)))
        return statistics.median(times)

    def set_kernel(self, kernel: str) -> None:
        if self.args.backend == "triton":
            from loraplex.gpu_engine.lora.triton_backend import TritonLoraBackend

            self.executor.model.lora = TritonLoraBackend(kernel=kernel)


def run(args: argparse.Namespace) -> dict[str, Any]:
    log(f"building a {args.shape} model on {args.device} ({args.dtype}, {args.backend} LoRA backend)")
    engine = Engine(args)
    if args.cuda_graphs == "on":
        log(f"decode graphs: {engine.graphs.buckets if engine.graphs.enabled else engine.graphs.reason}")
    report: dict[str, Any] = {"shape": args.shape, "device": args.device, "dtype": args.dtype,
                              "backend": args.backend, "context": args.context, **engine.graphs.as_dict(),
                              "gpu": torch.cuda.get_device_name(0) if args.device.startswith("cuda") else None,
                              "cpu": platform.processor() or platform.machine()}
    batch = max(args.batches)
    engine.set_kernel("auto")
    engine.decode_ms([None, engine.overhead_names[0]])  # warm-up: lazy initialisation and kernel compiles
    base = engine.decode_ms([None] * batch)
    names = [engine.overhead_names[i % len(engine.overhead_names)] for i in range(batch)]
    lora = engine.decode_ms(names)
    report["overhead"] = {"batch": batch, "distinct_adapters": len(set(names)), "rank": args.overhead_rank,
                          "base_step_ms": base, "lora_step_ms": lora, "overhead_pct": (lora / base - 1.0) * 100.0}
    log(f"batch {batch}: base {base:.2f} ms, {len(set(names))} adapters {lora:.2f} ms")
    if args.no_fit:
        return report
    samples: dict[str, list[dict[str, Any]]] = {"bgmv": [], "mbgmv": []}
    by_rank = engine.by_rank
    mixes = [[r] for r in args.ranks] + [list(args.ranks)]
    for kernel in ("bgmv", "mbgmv"):
        engine.set_kernel(kernel)
        for b in args.batches:
            for mix in mixes:
                ranks = [mix[i % len(mix)] for i in range(b)]
                names = [by_rank[r][i % len(by_rank[r])] for i, r in enumerate(ranks)]
                ms = engine.decode_ms(names)
                samples[kernel].append({"batch": b, "ranks": ranks, "step_ms": ms})
                log(f"{kernel} batch {b} ranks {sorted(set(ranks))}: {ms:.2f} ms")
        if args.backend != "triton":  # one LoRA path: both models are fitted to the same steps
            samples["mbgmv"] = samples["bgmv"]
            break
    fits = {"bgmv": fit_line([bgmv_x(s["ranks"]) for s in samples["bgmv"]], [s["step_ms"] for s in samples["bgmv"]]),
            "mbgmv": fit_line([mbgmv_x(s["ranks"]) for s in samples["mbgmv"]],
                              [s["step_ms"] for s in samples["mbgmv"]])}
    report["fits"] = fits
    report["samples"] = samples
    if args.profile_out is not None:
        from loraplex.daemon.router.rank_aware import KernelCost, PerfProfile

        profile = PerfProfile(bgmv=KernelCost(max(fits["bgmv"]["alpha"], 0.0), max(fits["bgmv"]["beta"], 0.0),
                                              r2=fits["bgmv"]["r2"]),
                              mbgmv=KernelCost(max(fits["mbgmv"]["alpha"], 0.0), max(fits["mbgmv"]["beta"], 0.0),
                                               r2=fits["mbgmv"]["r2"]))
        profile.save(args.profile_out)
        report["profile"] = str(args.profile_out)
        log(f"wrote {args.profile_out}")
    return report


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with torch.inference_mode():
        report = run(args)
    if args.json:
        print(json.dumps(report))
        return 0
    o = report["overhead"]
    graphs = f"CUDA graphs {report['graph_buckets']}" if report["cuda_graphs"] else "eager"
    print(f"{report['shape']} on {report['gpu'] or report['cpu']} ({report['dtype']}, {report['backend']}, {graphs})")
    print(f"decode step, batch {o['batch']}: base {o['base_step_ms']:.2f} ms, {o['distinct_adapters']} adapters "
          f"{o['lora_step_ms']:.2f} ms (+{o['overhead_pct']:.1f}%)")
    for kernel, fit in report.get("fits", {}).items():
        print(f"PERF_{kernel.upper()}: alpha {fit['alpha']:.5f} ms, beta {fit['beta']:.3f} ms, R² {fit['r2']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
