"""Packed CPU weights (model.cpu_packed_weights, gpu_engine/model/cpu_gemm.py) against F.linear
on the dense weights: each projection of `--shape` alone at several row counts, then the offline
`LLM` engine built both ways, side by side, on one mixed-adapter batch.

Per projection and row count: GFLOP/s of F.linear and of the packed path (median of
`--repeats`, the two taking turns so both meet the caches alike) and their ratio; under
PACKED_MIN_ROWS rows both are F.linear, which shows the noise of the host. Per engine: prefill
tokens/s (the batch's prompts, one output token) and generation tokens/s (`--max-tokens` each),
every run on prompts of its own (a repeated prompt would come from the prefix cache), median over
`--rounds` that alternate which build runs first, so a drift of the host's load falls on both
alike; and the ratios packed over plain.

    .venv/bin/python bench/cpu_gemm.py --json
    .venv/bin/python bench/cpu_gemm.py --shape tiny --rounds 1 --max-tokens 4 --json   # smoke
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from engine_threads import RANKS, build
from model_shapes import SHAPES, shape_config

from loraplex import LLM, SamplingParams
from loraplex.gpu_engine.model.cpu_gemm import CpuGemm, packed_linear_available

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="cpu")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1, as on a 2-core host)")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 128, 512], help="rows of the projection runs")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if min(*args.rows, args.repeats, args.batch, args.prompt_len, args.max_tokens, args.rounds, args.threads) < 1:
        p.error("every count must be positive")
    return args


def projection_shapes(shape: str) -> dict[str, tuple[int, int]]:
    """name -> (in, out) of each distinct projection of the shape."""
    c = shape_config(shape)
    hidden, inter = c["hidden_size"], c["intermediate_size"]
    kv = c["num_key_value_heads"] * hidden // c["num_attention_heads"]
    return {"q/o": (hidden, hidden), "k/v": (hidden, kv), "gate/up": (hidden, inter), "down": (inter, hidden)}


def timed_pair(first, second, repeats: int) -> tuple[float, float]:
    """Median seconds of each, the two taking turns (and turns at going first), so both meet the
    caches in the same state: timed one after the other, the second ran on weights the first had
    warmed (a 20-60% bias at one row)."""
    first(), second()
    times: tuple[list[float], list[float]] = ([], [])
    for r in range(repeats):
        for i in ((0, 1) if r % 2 == 0 else (1, 0)):
            fn = (first, second)[i]
            start = time.perf_counter()
            fn()
            times[i].append(time.perf_counter() - start)
    return statistics.median(times[0]), statistics.median(times[1])


def projections(args: argparse.Namespace) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    rows = []
    for name, (k, n) in projection_shapes(args.shape).items():
        w = torch.randn(n, k, generator=g)
        gemm = CpuGemm()
        for m in args.rows:
            x = torch.randn(m, k, generator=g)
            flops = 2 * m * k * n
            plain_s, packed_s = timed_pair(lambda: F.linear(x, w), lambda: gemm.linear(name, x, w), args.repeats)
            plain, packed = flops / plain_s / 1e9, flops / packed_s / 1e9
            rows.append({"projection": name, "in": k, "out": n, "rows": m, "f_linear_gflops": round(plain, 2),
                         "packed_gflops": round(packed, 2), "packed_over_plain": round(packed / plain, 3)})
            print(f"{name} [{k}->{n}] x {m} rows: F.linear {plain:.1f}, packed {packed:.1f} GFLOP/s",
                  file=sys.stderr)
    return rows


class Prompts:
    """Fresh random prompts for every call: a prompt seen before would be served from the prefix
    cache and time nothing."""

    def __init__(self, batch: int, length: int, vocab: int) -> None:
        self.batch, self.length, self.vocab = batch, length, vocab
        self.g = torch.Generator().manual_seed(1)

    def next(self) -> list[list[int]]:
        return [torch.randint(3, self.vocab, (self.length,), generator=self.g).tolist() for _ in range(self.batch)]


def tokens_per_s(llm: LLM, prompts: Prompts, adapters: list[str], max_tokens: int) -> tuple[float, float]:
    """(prompt tokens/s with one output token, output tokens/s of the whole generation), each on
    prompts of its own."""
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    batch = prompts.next()
    start = time.perf_counter()
    llm.generate(batch, adapters=adapters, sampling=one)
    prefill = sum(map(len, batch)) / (time.perf_counter() - start)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts.next(), adapters=adapters, sampling=params)
    return prefill, sum(len(o.token_ids) for o in outs) / (time.perf_counter() - start)


def engines(args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory(prefix="lpx-gemm-") as tmp:
        built = {mode: build(Path(tmp), args.shape, TARGETS, cpu_packed_weights=mode == "packed")
                 for mode in ("packed", "plain")}
        prompts = Prompts(args.batch, args.prompt_len, built["plain"][0].config.vocab_size)
        names = built["plain"][1]
        adapters = [names[i % len(names)] for i in range(args.batch)]
        runs: dict[str, dict[str, list[float]]] = {m: {"prefill": [], "generate": []} for m in built}
        for llm, _ in built.values():
            tokens_per_s(llm, prompts, adapters, min(4, args.max_tokens))  # warm-up (and the packing)
        for r in range(args.rounds):
            for mode in (("packed", "plain") if r % 2 == 0 else ("plain", "packed")):
                prefill, generate = tokens_per_s(built[mode][0], prompts, adapters, args.max_tokens)
                runs[mode]["prefill"].append(prefill)
                runs[mode]["generate"].append(generate)
                print(f"round {r}: {mode}: prefill {prefill:.0f} tok/s, generate {generate:.1f} tok/s", file=sys.stderr)
        packed_sites = built["packed"][0].executor.model.gemm.packed_weights
    out = {m: {k: round(statistics.median(v), 2) for k, v in r.items()} | {"runs": r} for m, r in runs.items()}
    out["packed_sites"] = packed_sites
    out["prefill_packed_over_plain"] = round(out["packed"]["prefill"] / out["plain"]["prefill"], 3)
    out["generate_packed_over_plain"] = round(out["packed"]["generate"] / out["plain"]["generate"], 3)
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not packed_linear_available():
        print("cpu_gemm: this torch has no oneDNN linear ops: nothing to compare", file=sys.stderr)
        return 1
    before = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        result = {"shape": args.shape, "threads": args.threads, "batch": args.batch, "prompt_len": args.prompt_len,
                  "max_tokens": args.max_tokens, "rounds": args.rounds, "adapter_ranks": list(RANKS),
                  "projections": projections(args), "engine": engines(args)}
    finally:
        torch.set_num_threads(before)
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        e = result["engine"]
        print(f"engine ({args.shape}, {args.threads} thread(s), batch {args.batch}): prefill packed/plain "
              f"{e['prefill_packed_over_plain']}, generate packed/plain {e['generate_packed_over_plain']}")
    return 0 if result["engine"]["packed_sites"] > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
