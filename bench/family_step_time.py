"""Decode step time of each served family's random demo beside Llama's (issue 32: no
architecture is a slow path). Every family's demo has the demo's shape (hidden 256, 4 layers,
GQA 8/4, head_dim 32); the runs interleave family by family, round by round, so a change in the
host's load falls on all of them alike. Reports each family's median decode ms per step (a full
generation minus its prefill-only run, over the decode steps) and its ratio to Llama's.
`--json`: one JSON object on stdout; progress on stderr.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import statistics
import sys
from typing import Any

import torch

from loraplex import LLM, SamplingParams
from loraplex.gpu_engine.demo import ensure_demo_model
from loraplex.gpu_engine.demo.families import FAMILIES

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from engine_throughput import FIRST_PROMPT_ID, adapter_mix, device_name, log, timed_generate  # noqa: E402


def parameters(llm: LLM) -> int:
    """Weights the model holds (a tied LM head counted once)."""
    w = llm.executor.model.w
    seen: set[int] = set()
    total = 0
    tensors = [w.embed, w.lm_head, w.norm, *(t for layer in w.layers for t in _layer_tensors(layer))]
    for t in tensors:
        if t is not None and id(t) not in seen:
            seen.add(id(t))
            total += t.numel()
    return total


def _layer_tensors(layer: Any) -> list[torch.Tensor]:
    out = []
    for value in (getattr(layer, f.name) for f in dataclasses.fields(layer)):
        if isinstance(value, torch.Tensor):
            out.append(value)
        elif isinstance(value, dict):
            out.extend(v for v in value.values() if isinstance(v, torch.Tensor))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--families", nargs="+", default=["llama", "qwen3", "gemma2"], choices=FAMILIES)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--adapters", choices=("mixed", "none"), default="mixed")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if "llama" not in args.families:
        args.families.insert(0, "llama")  # the baseline of every ratio
    if min(args.batch, args.prompt_len, args.rounds) < 1 or args.max_tokens < 2:
        p.error("--batch, --prompt-len and --rounds must be >= 1, --max-tokens >= 2")
    engines: dict[str, tuple[LLM, list[str | None]]] = {}
    for family in args.families:
        demo = ensure_demo_model(family=family)
        llm = LLM(demo.model_dir, device=args.device, dtype=args.dtype, max_num_seqs=max(64, args.batch))
        if args.adapters == "mixed":
            for name, path in demo.adapters.items():
                llm.add_adapter(name, path)
        engines[family] = (llm, adapter_mix(args.adapters, list(demo.adapters), args.batch))
        log(f"{family}: {parameters(llm):,} parameters")
    rng = random.Random(0)
    prompts = [[rng.randrange(FIRST_PROMPT_ID, 512) for _ in range(args.prompt_len)] for _ in range(args.batch)]
    full = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    first = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    step_ms: dict[str, list[float]] = {f: [] for f in engines}
    load_start = os.getloadavg()[0]
    for round_ in range(args.rounds + 1):  # round 0 warms every engine up
        for family, (llm, adapters) in engines.items():
            seconds, _ = timed_generate(llm, prompts, adapters, full)
            prefill, _ = timed_generate(llm, prompts, adapters, first)
            if round_:
                step_ms[family].append(1e3 * (seconds - prefill) / (args.max_tokens - 1))
        if round_:
            log(f"round {round_}/{args.rounds}: " + ", ".join(f"{f} {v[-1]:.1f} ms" for f, v in step_ms.items()))
    base = statistics.median(step_ms["llama"])
    report = {
        "benchmark": "family_step_time",
        "env": {"torch": torch.__version__, "device": args.device, "device_name": device_name(args.device),
                "threads": torch.get_num_threads(), "loadavg_1m": [load_start, os.getloadavg()[0]]},
        "config": {k: getattr(args, k) for k in ("batch", "prompt_len", "max_tokens", "rounds", "adapters", "dtype")},
        "results": [{"family": f, "parameters": parameters(engines[f][0]), "decode_ms_per_step": v,
                     "decode_ms_median": statistics.median(v), "ratio_to_llama": statistics.median(v) / base}
                    for f, v in step_ms.items()],
    }
    if args.json:
        print(json.dumps(report))
    else:
        for r in report["results"]:
            print(f"{r['family']:>12} {r['parameters']:>10,} params  {r['decode_ms_median']:7.2f} ms/step  "
                  f"{r['ratio_to_llama']:.2f}x llama")
    return 0


if __name__ == "__main__":
    sys.exit(main())
