"""Prefix caching on a multi-turn chat workload: TTFT and prefill tokens with the cache off,
with separate budgets (the prefix cache capped at a share of the pool, idle adapters evicted
before any prefix page), and with one eviction order for prefixes and adapters, side by side.

The daemon's own scheduler, allocator, adapter residency and prefix cache run in its
simulator (daemon/sim: the decisions a live daemon makes, with a latency model of the
engine instead of a model; the simulated model's answers continue each conversation, so a
next turn's prompt holds the last answer as a chat history does).

Workload, from the Azure LLM conversation trace (../shared/traces): rows in file order are
turns; each conversation takes `--turns` rows spaced `--interleave` rows apart (so other
conversations' turns come between two of its own). A first turn's prompt is the row's
context tokens (a system prompt plus the first message); each later turn's prompt is the
last prompt, its answer and a new user message of the row's context tokens divided by
`--message-divisor`. Each conversation talks to one adapter, Zipf-popular over `--adapters`
adapters of ranks 8-128 (a share `--base-share` talks to the base model). Arrivals follow
the trace's timestamps, sped up `--time-scale` times.

`--json` prints one JSON object on stdout; progress goes to stderr.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time

from loraplex.daemon.sim.metrics import QUANTILES, pct
from loraplex.daemon.sim.profile import SimProfile
from loraplex.daemon.sim.simulator import SimConfig, simulate
from loraplex.daemon.sim.workload import RequestEvent, read_trace, trace_path, zipf_weights

MODES = {"off": dict(prefix_cache=False), "separate": dict(prefix_eviction="separate"),
         "unified": dict(prefix_eviction="unified")}
RANKS = (8, 16, 32, 64, 128)


def log(msg: str) -> None:
    print(f"[prefix_cache] {msg}", file=sys.stderr, flush=True)


def chat_workload(args: argparse.Namespace, max_model_len: int) -> list[RequestEvent]:
    rows = read_trace(trace_path(args.trace))
    rng = random.Random(args.seed)
    names = [f"chat{i:03d}" for i in range(args.adapters)]
    ranks = {name: rng.choice(RANKS) for name in names}
    weights = zipf_weights(args.adapters, args.zipf)
    events: list[RequestEvent] = []
    block = args.turns * args.interleave  # rows one group of interleaved conversations takes
    for start in range(0, min(len(rows), args.requests) - block + 1, block):
        for lane in range(args.interleave):
            conv = f"c{start + lane:05d}"
            adapter = None if rng.random() < args.base_share else rng.choices(names, weights)[0]
            prompt = 0
            for turn in range(args.turns):
                t, context, generated = rows[start + lane + turn * args.interleave]
                output = max(1, min(generated, args.max_output))
                grow = context if turn == 0 else max(1, context // args.message_divisor)
                prompt = min(prompt + grow, max_model_len - output - 1)
                if prompt <= 0:
                    break
                events.append(RequestEvent(request_id=f"{conv}-t{turn}", arrival_s=t / args.time_scale,
                                           adapter=adapter, rank=ranks[adapter] if adapter else 0,
                                           prompt_len=prompt, output_len=output, conversation=conv))
                prompt += output  # the answer is part of the next turn's history
    events.sort(key=lambda e: e.arrival_s)
    return events


def run_mode(name: str, events: list[RequestEvent], profile: SimProfile, policy: str) -> dict[str, object]:
    began = time.perf_counter()
    result = simulate(events, SimConfig(policy=policy, mode="on_demand", **MODES[name]), profile)
    ttft = sorted(r.ttft_s * 1e3 for r in result.records if r.ttft_s is not None)
    prompt_tokens = sum(e.prompt_len for e in events)
    hit = result.prefix.get("hit_tokens", 0)
    row: dict[str, object] = {
        "mode": name, "requests": len(events), "finished": len(ttft),
        "prompt_tokens": prompt_tokens, "cached_prompt_tokens": hit,
        "prefill_tokens": prompt_tokens - hit,
        "prefix_hit_rate": round(hit / prompt_tokens, 4) if prompt_tokens else 0.0,
        "prefix_evicted_pages": result.prefix.get("evicted_pages", 0),
        "adapter_hit_rate": round(result.cache_hits / max(1, result.cache_hits + result.cache_misses), 4),
        "mean_ttft_ms": round(sum(ttft) / len(ttft), 2) if ttft else None,
        "makespan_s": round(result.makespan_s, 2), "sim_seconds": round(time.perf_counter() - began, 2),
    }
    row.update({f"{q}_ttft_ms": round(pct(ttft, x), 2) for q, x in QUANTILES})
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trace", default="conv", help="conv | code | a CSV path (default conv)")
    p.add_argument("--requests", type=int, default=2400, help="trace rows used (turns in all)")
    p.add_argument("--turns", type=int, default=4, help="turns per conversation")
    p.add_argument("--interleave", type=int, default=24, help="conversations whose turns alternate")
    p.add_argument("--message-divisor", type=int, default=8,
                   help="a later turn's new message: the row's context tokens divided by this")
    p.add_argument("--max-output", type=int, default=256)
    p.add_argument("--adapters", type=int, default=60)
    p.add_argument("--zipf", type=float, default=1.0)
    p.add_argument("--base-share", type=float, default=0.1)
    p.add_argument("--time-scale", type=float, default=0.5,
                   help="speed-up of the trace's arrivals (0.5: half as fast, "
                        "a load the cache-off engine only just carries)")
    p.add_argument("--pool-pages", type=int, default=4000, help="the simulated engine's unified pool")
    p.add_argument("--policy", default="fcfs")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="a few hundred turns (seconds)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if args.quick:
        args.requests, args.interleave = 192, 16
    profile = SimProfile(pool_pages=args.pool_pages)
    events = chat_workload(args, profile.max_model_len)
    log(f"{len(events)} turns of {len({e.conversation for e in events})} conversations; "
        f"{sum(e.prompt_len for e in events)} prompt tokens")
    rows = []
    for name in MODES:
        rows.append(run_mode(name, events, profile, args.policy))
        log(f"{name}: p50 TTFT {rows[-1]['p50_ttft_ms']} ms, p99 {rows[-1]['p99_ttft_ms']} ms, "
            f"prefill {rows[-1]['prefill_tokens']} tokens ({rows[-1]['sim_seconds']} s)")
    off = rows[0]
    for row in rows[1:]:
        row["prefill_tokens_vs_off"] = round(row["prefill_tokens"] / max(1, off["prefill_tokens"]), 4)
        row["p50_ttft_vs_off"] = round(row["p50_ttft_ms"] / max(1e-9, off["p50_ttft_ms"]), 4)
        row["p99_ttft_vs_off"] = round(row["p99_ttft_ms"] / max(1e-9, off["p99_ttft_ms"]), 4)
    out = {"benchmark": "prefix_cache", "config": {k: v for k, v in vars(args).items() if k != "json"},
           "profile": profile.to_dict(), "results": rows}
    if args.json:
        print(json.dumps(out))
    else:
        for row in rows:
            print(row)
    return 0


if __name__ == "__main__":
    sys.exit(main())
