"""Engine throughput by torch thread count, on a quiet host and beside a busy process.

torch's parallel regions wait for their slowest thread: an engine running as many threads as
cores stalls every op when another process takes one of them. This measures the offline `LLM`
(the engine without the daemon) decoding a mixed-adapter batch at a random-weight shape
(`--shape`, default `cpu`: ~160M parameters), for each `--threads` count, once with the host
quiet and once beside `--hogs` processes that spin on the CPU, alternating the two in every
round so a drift of the host's load falls on both alike.

Per thread count: output tokens/s quiet and busy (median over rounds), `busy_over_quiet`
(throughput kept beside the hogs) and `quiet_over_best` (throughput given up on a quiet host
against the best count). `auto` is the engine's default (model.cpu_threads unset).

    .venv/bin/python bench/engine_threads.py --json
    .venv/bin/python bench/engine_threads.py --shape tiny --rounds 1 --max-tokens 4 --json   # smoke
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
from hogs import Hogs
from model_shapes import SHAPES, shape_config, write_model_dir

from loraplex import LLM, SamplingParams
from loraplex.contracts.host import usable_cores
from loraplex.gpu_engine.demo import write_random_adapter
from loraplex.gpu_engine.runtime import auto_cpu_threads

RANKS = (8, 16, 32, 64)
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="cpu")
    p.add_argument("--threads", nargs="+", default=["1", "auto", "all"],
                   help="thread counts: integers, auto (the engine's default), all (every usable core)")
    p.add_argument("--hogs", type=int, default=1, help="busy processes beside the engine (default 1)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    for t in args.threads:
        if t not in ("auto", "all") and not (t.isdigit() and int(t) > 0):
            p.error(f"--threads: {t!r} is not a positive integer, auto or all")
    if min(args.batch, args.prompt_len, args.max_tokens, args.rounds) < 1 or args.hogs < 0:
        p.error("--batch, --prompt-len, --max-tokens and --rounds must be positive, --hogs >= 0")
    return args


def thread_count(name: str, cores: int) -> int:
    return {"auto": auto_cpu_threads(cores, 1), "all": cores}.get(name) or int(name)


def build(root: Path, shape: str, targets: list[str] = TARGETS, **llm_options) -> tuple[LLM, list[str]]:
    """The offline engine on a dummy-weight `shape` under `root`, with one adapter of each of RANKS
    on `targets` (written once: a second build under the same root reuses them)."""
    config = shape_config(shape)
    model_dir = write_model_dir(root / "model", shape)
    llm = LLM(model_dir, load_format="dummy", max_model_len=1024, num_pages=512, **llm_options)
    names = []
    for i, rank in enumerate(RANKS):
        path = root / f"r{rank}"
        if not (path / "adapter_config.json").exists():
            write_random_adapter(path, config, rank=rank, alpha=2.0 * rank, target_modules=targets, seed=10 + i)
        llm.add_adapter(f"r{rank}", path)
        names.append(f"r{rank}")
    return llm, names


def tokens_per_s(llm: LLM, prompts: list[list[int]], adapters: list[str], max_tokens: int) -> float:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, adapters=adapters, sampling=params)
    elapsed = time.perf_counter() - start
    return sum(len(o.token_ids) for o in outs) / elapsed


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cores = usable_cores()
    counts = {name: thread_count(name, cores) for name in args.threads}
    before = torch.get_num_threads()
    with tempfile.TemporaryDirectory(prefix="lpx-threads-") as tmp:
        llm, names = build(Path(tmp), args.shape)
        g = torch.Generator().manual_seed(0)
        vocab = llm.config.vocab_size
        prompts = [torch.randint(3, vocab, (args.prompt_len,), generator=g).tolist() for _ in range(args.batch)]
        adapters = [names[i % len(names)] for i in range(args.batch)]
        tokens_per_s(llm, prompts, adapters, min(4, args.max_tokens))  # warm-up: every adapter and the batch size
        runs: dict[str, dict[str, list[float]]] = {name: {"quiet": [], "busy": []} for name in counts}
        for r in range(args.rounds):
            for name, n in counts.items():
                torch.set_num_threads(n)
                order = ("quiet", "busy") if r % 2 == 0 else ("busy", "quiet")
                for when in order:
                    if when == "busy":
                        with Hogs(args.hogs):
                            runs[name][when].append(tokens_per_s(llm, prompts, adapters, args.max_tokens))
                    else:
                        runs[name][when].append(tokens_per_s(llm, prompts, adapters, args.max_tokens))
                    print(f"round {r}: threads {name} ({n}) {when}: {runs[name][when][-1]:.1f} tok/s",
                          file=sys.stderr)
    torch.set_num_threads(before)
    best = max(statistics.median(v["quiet"]) for v in runs.values())
    rows = []
    for name, n in counts.items():
        quiet, busy = statistics.median(runs[name]["quiet"]), statistics.median(runs[name]["busy"])
        rows.append({"threads": name, "count": n, "quiet_tok_s": round(quiet, 2), "busy_tok_s": round(busy, 2),
                     "busy_over_quiet": round(busy / quiet, 3), "quiet_over_best": round(quiet / best, 3),
                     "busy_over_best_quiet": round(busy / best, 3), "quiet_runs": runs[name]["quiet"],
                     "busy_runs": runs[name]["busy"]})
    result = {"shape": args.shape, "cores": cores, "hogs": args.hogs, "batch": args.batch,
              "prompt_len": args.prompt_len, "max_tokens": args.max_tokens, "rounds": args.rounds,
              "adapter_ranks": list(RANKS), "rows": rows}
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        for row in rows:
            print(f"threads {row['threads']:>4} ({row['count']}): quiet {row['quiet_tok_s']:7.1f} tok/s, "
                  f"busy {row['busy_tok_s']:7.1f} tok/s, busy/quiet {row['busy_over_quiet']:.2f}, "
                  f"quiet/best {row['quiet_over_best']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
