"""Generation throughput of the built-in demo model through the offline `LLM` API.

`--family` runs the random demo of another served family at the same shape (hidden 256,
4 layers, GQA 8/4, head_dim 32; gemma2 with its sliding windows and soft-caps), so one
architecture's step time can be set beside Llama's.

Measures output tokens/s, end-to-end seconds and (from max_tokens=1 runs) prefill
throughput per batch size, with demo adapters mixed into the batch or not.
Writes results to stdout only (`--json`: one JSON object); progress goes to stderr.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import statistics
import sys
import time
from typing import Any

import torch

from loraplex import LLM, SamplingParams
from loraplex.gpu_engine.demo import ensure_demo_model
from loraplex.gpu_engine.demo.families import FAMILIES

SINGLE_ADAPTER = "all-r32"  # the demo adapter touching all seven projections
FIRST_PROMPT_ID = 3  # skip the demo tokenizer's special ids (pad, bos, eos)


def device_name(device: str) -> str:
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def adapter_mix(mode: str, names: list[str], batch: int) -> list[str | None]:
    """Adapter of each row: `mixed` cycles base, then every demo adapter; `single` uses one adapter."""
    if mode == "none":
        return [None] * batch
    if mode == "single":
        return [SINGLE_ADAPTER] * batch
    cycle: list[str | None] = [None, *names]
    return [cycle[i % len(cycle)] for i in range(batch)]


def timed_generate(llm: LLM, prompts: list[list[int]], adapters: list[str | None],
                   params: SamplingParams) -> tuple[float, int]:
    """(seconds, output tokens) of one generate call."""
    sync = torch.cuda.synchronize if llm.device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    outputs = llm.generate(prompts, adapters=adapters, sampling=params)
    sync()
    return time.perf_counter() - t0, sum(len(o.token_ids) for o in outputs)


def bench_batch(llm: LLM, batch: int, args: argparse.Namespace, names: list[str]) -> dict[str, Any]:
    rng = random.Random(args.seed + batch)
    vocab = llm.config.vocab_size
    prompts = [[rng.randrange(FIRST_PROMPT_ID, vocab) for _ in range(args.prompt_len)] for _ in range(batch)]
    adapters = adapter_mix(args.adapters, names, batch)
    full = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    first = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)

    log(f"batch {batch}: warm-up")
    timed_generate(llm, prompts, adapters, full)
    e2e: list[float] = []
    prefill: list[float] = []
    out_tokens = 0
    for i in range(args.repeats):
        seconds, out_tokens = timed_generate(llm, prompts, adapters, full)
        e2e.append(seconds)
        prefill.append(timed_generate(llm, prompts, adapters, first)[0])
        log(f"batch {batch}: run {i + 1}/{args.repeats} {seconds:.3f} s")
    e2e_med = statistics.median(e2e)
    prefill_med = statistics.median(prefill)
    decode_s = e2e_med - prefill_med
    decode_tokens = out_tokens - batch  # the first token of each row comes out of prefill
    return {
        "batch": batch,
        "adapters": adapters,
        "output_tokens": out_tokens,
        "e2e_s_median": e2e_med,
        "e2e_s": e2e,
        "output_tok_s_median": statistics.median(out_tokens / s for s in e2e),
        "prefill_s_median": prefill_med,
        "prefill_tok_s": batch * args.prompt_len / prefill_med,
        # Derived: (full run - max_tokens=1 run) medians; null when too short to separate.
        "decode_tok_s": decode_tokens / decode_s if decode_tokens > 0 and decode_s > 0 else None,
    }


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def print_table(report: dict[str, Any]) -> None:
    env, cfg = report["env"], report["config"]
    print(f"torch {env['torch']}  device {env['device']} ({env['device_name']})  threads {env['threads']}  "
          f"dtype {cfg['dtype']}  load {env['loadavg_1m'][0]:.2f}->{env['loadavg_1m'][1]:.2f}")
    print(f"prompt {cfg['prompt_len']} tokens, max_tokens {cfg['max_tokens']}, adapters {cfg['adapters']}, "
          f"median of {cfg['repeats']} runs")
    header = f"{'batch':>5} {'out tok/s':>10} {'e2e s':>8} {'prefill tok/s':>14} {'decode tok/s':>13}"
    print(header)
    for r in report["results"]:
        decode = "-" if r["decode_tok_s"] is None else f"{r['decode_tok_s']:.1f}"
        print(f"{r['batch']:>5} {r['output_tok_s_median']:>10.1f} {r['e2e_s_median']:>8.3f} "
              f"{r['prefill_tok_s']:>14.1f} {decode:>13}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 16], help="batch sizes (default: 1 16)")
    p.add_argument("--adapters", choices=("mixed", "none", "single"), default="mixed",
                   help=f"mixed: rows cycle base + each demo adapter; single: all rows {SINGLE_ADAPTER}")
    p.add_argument("--prompt-len", type=int, default=64, help="random prompt tokens per row (default 64)")
    p.add_argument("--max-tokens", type=int, default=64, help="output tokens per row (default 64)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per batch after one warm-up (default 3)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    p.add_argument("--family", default="llama", choices=FAMILIES,
                   help="the random demo of this family at the demo's shape (default llama: the built-in demo)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's choice)")
    p.add_argument("--num-pages", type=int, default=None, help="pool pages (default: the engine's choice)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    args = p.parse_args(argv)
    if min(args.batch) < 1 or args.prompt_len < 1 or args.max_tokens < 1 or args.repeats < 1:
        p.error("--batch, --prompt-len, --max-tokens and --repeats must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    demo = ensure_demo_model(family=args.family)
    log(f"loading the {args.family} demo model from {demo.model_dir} on {args.device}")
    llm = LLM(demo.model_dir, device=args.device, dtype=args.dtype, num_pages=args.num_pages,
              max_num_seqs=max(64, max(args.batch)))
    names = list(demo.adapters)
    if args.adapters != "none":
        for name, path in demo.adapters.items():
            llm.add_adapter(name, path)
    load_start = os.getloadavg()[0]
    results = [bench_batch(llm, b, args, names) for b in args.batch]
    report = {
        "benchmark": "engine_throughput",
        "env": {
            "torch": torch.__version__,
            "python": platform.python_version(),
            "device": args.device,
            "device_name": device_name(args.device),
            "threads": torch.get_num_threads(),
            "cpu_count": os.cpu_count(),
            # Host 1-minute load average before and after the runs: other processes skew CPU timings.
            "loadavg_1m": [load_start, os.getloadavg()[0]],
        },
        "config": {
            "model": "demo", "family": args.family, "dtype": args.dtype, "adapters": args.adapters,
            "prompt_len": args.prompt_len,
            "max_tokens": args.max_tokens, "repeats": args.repeats, "seed": args.seed,
            "page_tokens": llm.geometry.page_tokens, "num_pages": llm.allocator.num_pages,
        },
        "results": results,
    }
    if args.json:
        print(json.dumps(report, allow_nan=False))
    else:
        print_table(report)
    return 0 if all(math.isfinite(r["output_tok_s_median"]) for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
