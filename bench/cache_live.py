"""Live GPU-adapter-cache policies on CPU: hit rate and TTFT of a real daemon per
cache policy, under Zipf adapter popularity with ranks 8-128 (Chameleon §5.3).

Writes --adapters random PEFT adapters (all seven projections, ranks drawn uniformly from
8, 16, 32, 64, 128 by the shared workload generator) for the random CPU demo model, then
per policy starts `loraplex serve` in a private runtime dir (on_demand loads) with a pool
of --num-pages pages: room for the KV of a full batch plus --pool-fraction of all adapter
pages, so a popular working set fits but not every adapter. The engine's test-only load
throttle (model.load_throttle_bytes_s) makes a cold load cost tens of ms, like a PCIe copy
next to a 7B step; it models one shared link, so concurrent loads queue as they do on the
GPU's copy stream. Each load in --rates replays the same seeded Poisson/Zipf request
sequence (daemon.sim.workload) through the client library, open loop and streamed
(daemon.sim.loadgen); loads run in increasing order on the same daemon. --rounds repeats
it all with the policies interleaved, fresh daemons each round.

Per policy and load: requests, completed, hit rate (from the daemon's adapter_paths: cached
or merged over all adapter requests), mean/P50/P90/P99 TTFT at the client (over the requests
of all rounds) and P99 per round, adapter MB loaded, and per load the P99 TTFT ratios
cost/lru and cost/none (and each POLICY/POLICY+stall pair run). Cold requests wait in the
queue while their adapter is copied (scheduler.admit_when_loaded, the default); a
`POLICY+stall` variant turns that off, so the step that admits them waits for the copy. The
workload's adapters map onto the live ones by popularity (loadgen); ranks are drawn
independently of it. `--model DIR --device cuda --throttle-bytes-s 0` runs the same on a GPU
host with a real model. `--json` prints one JSON object on stdout; progress goes to stderr.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

from soak import start_daemon, stop_daemon

from loraplex.contracts.geometry import PageGeometry, plan_adapter_layout
from loraplex.daemon.gpu_cache.policies import POLICY_NAMES
from loraplex.daemon.sim.loadgen import drive
from loraplex.daemon.sim.metrics import QUANTILES, pct
from loraplex.daemon.sim.workload import WorkloadSpec, adapter_ranks, generate

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
MAX_NUM_SEQS = 16


def _log(msg: str) -> None:
    print(f"[cache_live] {msg}", file=sys.stderr, flush=True)


def parse_variant(label: str) -> tuple[str, bool]:
    """`POLICY` or `POLICY+stall`: the cache policy, and whether cold requests stall the step
    (scheduler.admit_when_loaded off) instead of waiting in the queue for their copy."""
    policy, plus, suffix = label.partition("+")
    if policy not in POLICY_NAMES or (plus and suffix != "stall"):
        raise ValueError(f"unknown policy variant {label!r}: POLICY[+stall], POLICY one of {', '.join(POLICY_NAMES)}")
    return policy, suffix == "stall"


def write_adapters(root: Path, spec: WorkloadSpec, model_config: dict) -> dict[str, tuple[Path, int]]:
    """One random PEFT adapter per workload adapter name, with the workload's rank."""
    from loraplex.gpu_engine.demo.adapter import write_random_adapter

    out = {}
    for i, (name, rank) in enumerate(adapter_ranks(spec).items()):
        dest = root / name
        write_random_adapter(dest, model_config, rank=rank, alpha=float(rank), target_modules=list(TARGETS),
                             seed=10_000 * (spec.seed + 1) + i)
        out[name] = (dest, rank)
    return out


def adapter_pages(model_config: dict, ranks: list[int]) -> tuple[PageGeometry, list[int]]:
    """The pool geometry the engine will use, and each adapter's page count in it."""
    from loraplex.gpu_engine.demo.checkpoint import projection_shapes

    shapes = {m: (i, o) for m, (o, i) in projection_shapes(model_config).items()}
    head_dim = model_config.get("head_dim") or model_config["hidden_size"] // model_config["num_attention_heads"]
    geometry = PageGeometry.for_model(shapes, int(model_config["num_key_value_heads"]) * int(head_dim))
    return geometry, [plan_adapter_layout(geometry, shapes, TARGETS, r).num_pages for r in ranks]


def pool_size(geometry: PageGeometry, pages: list[int], fraction: float, max_tokens: int) -> int:
    """KV for a full batch of the longest requests, plus `fraction` of all adapter pages (at
    least twice the largest adapter, so one can be placed while another large one is in use)."""
    kv = MAX_NUM_SEQS * geometry.kv_pages_for(max_tokens)
    return kv + max(int(fraction * sum(pages)), 2 * max(pages))


def warm_up(runtime_dir: Path, n: int = 8) -> None:
    """A few base-model requests, so the first measured ones do not pay the engine's warm-up
    (base only: the adapter cache starts empty under every policy)."""
    from loraplex.ipc.client import Client

    with Client(runtime_dir=runtime_dir) as c:
        for i in range(n):
            c.generate([5 + i, 6, 7, 8] * 8, max_tokens=4, temperature=0.0, ignore_eos=True, timeout=120.0)


def one_load(runtime_dir: Path, spec: WorkloadSpec, vocab: int) -> dict:
    """One replay of `spec`: the raw figures of one round (merged over rounds by `merge`)."""
    events = generate(spec)
    result = asyncio.run(drive(events, runtime_dir=runtime_dir, vocab=vocab, max_prompt=spec.max_prompt,
                               ttft_slo_ms=1e9, tpt_slo_ms=1e9, timeout_s=300.0))
    done = [r for r in result.records if r.finish_s is not None and not r.aborted]
    return {"requests": len(result.records), "completed": len(done),
            "aborted": sum(r.aborted for r in result.records), "hits": result.cache_hits,
            "misses": result.cache_misses, "ttft_ms": [r.ttft_s * 1e3 for r in done if r.ttft_s is not None],
            "makespan_s": result.makespan_s, "adapter_bytes": result.pcie_bytes}


def merge(rate: float, rounds: list[dict]) -> dict:
    """One policy at one load: counts summed and TTFT percentiles over the requests of every round."""
    total = {k: sum(r[k] for r in rounds) for k in ("requests", "completed", "aborted", "hits", "misses")}
    ttft = sorted(t for r in rounds for t in r["ttft_ms"])
    accesses = total["hits"] + total["misses"]
    span = sum(r["makespan_s"] for r in rounds)
    return {"rate_rps": rate, **total, "hit_rate": round(total["hits"] / accesses, 4) if accesses else None,
            "ttft_ms": {"mean": round(sum(ttft) / len(ttft), 2) if ttft else 0.0,
                        **{q: round(pct(ttft, x), 2) for q, x in QUANTILES}},
            "ttft_p99_ms_by_round": [round(pct(sorted(r["ttft_ms"]), 0.99), 2) for r in rounds],
            "throughput_rps": round(total["completed"] / span, 2) if span else 0.0,
            "adapter_mb_loaded": round(sum(r["adapter_bytes"] for r in rounds) / 1e6 / len(rounds), 1)}


def run(args: argparse.Namespace) -> dict:
    from loraplex.gpu_engine.demo import ensure_demo_model
    from loraplex.gpu_engine.demo.model import demo_model_config

    if args.model is None:
        model_dir = ensure_demo_model().model_dir
        model_config = demo_model_config()
    else:
        model_dir = args.model
        model_config = json.loads((model_dir / "config.json").read_text())
    vocab = int(model_config["vocab_size"])
    specs = [WorkloadSpec(seed=args.seed, duration_s=args.duration, max_requests=args.max_requests, rate_rps=rate,
                          num_adapters=args.adapters, zipf_exponent=args.zipf, prompt_mean=args.prompt_mean,
                          output_mean=args.output_mean, max_prompt=args.max_prompt, max_output=args.max_output)
             for rate in args.rates]
    loadavg_before = os.getloadavg()[0]
    results: dict[str, list[dict]] = {}
    exits: dict[str, list[int]] = {}
    with tempfile.TemporaryDirectory(prefix="lpx-cache-live-") as tmp:
        root = Path(tmp)
        adapters = write_adapters(root / "adapters", specs[0], model_config)
        ranks = [rank for _, rank in adapters.values()]
        geometry, pages = adapter_pages(model_config, ranks)
        num_pages = args.num_pages or pool_size(geometry, pages, args.pool_fraction,
                                                args.max_prompt + args.max_output)
        serve = ["--model", str(model_dir), "--num-pages", str(num_pages), "--max-num-seqs", str(MAX_NUM_SEQS),
                 "--adapter-load-mode", "on_demand", "--device", args.device]
        for name, (path, _) in adapters.items():
            serve += ["--adapter", f"{name}={path}"]
        # The daemon reads model.load_throttle_bytes_s from its environment (LORAPLEX_MODEL_*).
        if args.throttle_bytes_s:
            os.environ["LORAPLEX_MODEL_LOAD_THROTTLE_BYTES_S"] = str(args.throttle_bytes_s)
        else:  # the real link (the throttle only acts on CPU)
            os.environ.pop("LORAPLEX_MODEL_LOAD_THROTTLE_BYTES_S", None)
        if args.engine_threads:
            # On a shared 2-core host, torch's OpenMP threads spin against other processes and
            # single steps of the tiny model stall for seconds; one thread keeps TTFT about policy.
            os.environ["OMP_NUM_THREADS"] = str(args.engine_threads)
        _log(f"{len(adapters)} adapters, {sum(pages)} adapter pages in all, pool {num_pages} pages")
        # Rounds interleave the policies (none, lru, cost, none, ...) so slow drift in the host's
        # load does not land on one policy; every round starts fresh daemons.
        for rnd in range(args.rounds):
            for policy in args.policies:
                home = root / f"{policy}-{rnd}"
                home.mkdir()
                _log(f"round {rnd + 1}/{args.rounds}, {policy}: starting the daemon")
                cache_policy, stall = parse_variant(policy)
                # A "+stall" variant admits a cold request at once, its step waiting for the copy.
                os.environ["LORAPLEX_SCHEDULER_ADMIT_WHEN_LOADED"] = "false" if stall else "true"
                proc, runtime_dir = start_daemon(home, [*serve, "--cache-policy", cache_policy])
                try:
                    warm_up(runtime_dir)
                    for i, spec in enumerate(specs):
                        started = time.monotonic()
                        raw = one_load(runtime_dir, spec, vocab)
                        results.setdefault(policy, [[] for _ in specs])[i].append(raw)
                        row = merge(spec.rate_rps, [raw])
                        _log(f"{policy} @ {spec.rate_rps} rps: {row['completed']}/{row['requests']} done, hit rate "
                             f"{row['hit_rate']}, TTFT p50 {row['ttft_ms']['p50']} p99 {row['ttft_ms']['p99']} ms "
                             f"({time.monotonic() - started:.1f} s)")
                finally:
                    exits.setdefault(policy, []).append(stop_daemon(proc))
                    if exits[policy][-1] != 0:
                        _log(f"{policy}: daemon exited with {exits[policy][-1]}")
    table = []
    for i, spec in enumerate(specs):
        by_policy = {p: merge(spec.rate_rps, results[p][i]) for p in args.policies}
        ratios = {}
        pairs = [("cost", "lru"), ("cost", "none")]
        pairs += [(p, f"{p}+stall") for p in POLICY_NAMES]
        for mine, other in pairs:
            if mine in by_policy and other in by_policy and by_policy[other]["ttft_ms"]["p99"] > 0:
                ratios[f"{mine}_over_{other}"] = round(by_policy[mine]["ttft_ms"]["p99"]
                                                       / by_policy[other]["ttft_ms"]["p99"], 3)
        table.append({"rate_rps": spec.rate_rps, "policies": by_policy, "p99_ttft_ratio": ratios})
    top = table[-1]["p99_ttft_ratio"]
    return {
        "benchmark": "cache_live",
        "config": {"adapters": args.adapters, "ranks": dict(zip(adapters, ranks)), "adapter_pages": sum(pages),
                   "num_pages": num_pages, "page_tokens": geometry.page_tokens, "pool_fraction": args.pool_fraction,
                   "zipf_exponent": args.zipf, "rates": args.rates, "duration_s": args.duration, "rounds": args.rounds,
                   "max_requests": args.max_requests, "prompt_mean": args.prompt_mean,
                   "output_mean": args.output_mean, "throttle_bytes_s": args.throttle_bytes_s,
                   "engine_threads": args.engine_threads, "policies": args.policies, "seed": args.seed,
                   "model": str(model_dir), "hidden_size": model_config["hidden_size"],
                   "num_hidden_layers": model_config["num_hidden_layers"],
                   "serve_args": serve[:serve.index("--adapter")]},
        "results": table,
        "daemon_exit": exits,
        "targets": {"cost_p99_le_lru_per_rate": [r["p99_ttft_ratio"].get("cost_over_lru", 2.0) <= 1.0 for r in table]
                    if {"cost", "lru"} <= set(args.policies) else None,
                    "cost_p99_le_half_none_at_highest_rate": top.get("cost_over_none", 2.0) <= 0.5
                    if {"cost", "none"} <= set(args.policies) else None},
        "environment": {"device": args.device, "cpu_count": os.cpu_count(), "python": platform.python_version(),
                        "loadavg_1m_before": loadavg_before, "loadavg_1m_after": os.getloadavg()[0]},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--adapters", type=int, default=32, help="adapters written and registered (default 32)")
    parser.add_argument("--policies", default="none,lru,cost",
                        help="comma-separated cache policies; POLICY+stall: cold requests join the batch at "
                             "once and the step waits for their copy (scheduler.admit_when_loaded off)")
    parser.add_argument("--rates", default="4,10,20", help="comma-separated arrival rates, req/s")
    parser.add_argument("--duration", type=float, default=12.0, help="seconds of arrivals per load")
    parser.add_argument("--max-requests", type=int, default=None, help="cap on requests per load")
    parser.add_argument("--rounds", type=int, default=1,
                        help="repeat everything, policies interleaved; TTFT percentiles pool all rounds")
    parser.add_argument("--zipf", type=float, default=1.0, help="Zipf exponent of adapter popularity")
    parser.add_argument("--pool-fraction", type=float, default=0.3,
                        help="share of all adapter pages the pool holds besides KV (default 0.3)")
    parser.add_argument("--num-pages", type=int, default=None, help="pool size in pages (overrides --pool-fraction)")
    parser.add_argument("--throttle-bytes-s", type=float, default=2e8,
                        help="adapter load bandwidth on CPU (default 2e8: a rank-128 adapter of the demo model "
                             "~50 ms, rank 8 ~3 ms); 0: no throttle (on a GPU, the real link)")
    parser.add_argument("--model", type=Path, default=None,
                        help="a Llama-family model directory to serve (default: the built-in demo model); "
                             "the adapters are written for its shapes")
    parser.add_argument("--device", default="cpu", help="the daemon's --device (default cpu; cuda on a GPU host)")
    parser.add_argument("--engine-threads", type=int, default=1,
                        help="OMP_NUM_THREADS of the daemon's processes (default 1; 0: inherit)")
    parser.add_argument("--prompt-mean", type=int, default=32)
    parser.add_argument("--output-mean", type=int, default=8)
    parser.add_argument("--max-prompt", type=int, default=128)
    parser.add_argument("--max-output", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    args = parser.parse_args(argv)
    args.policies = [p for p in args.policies.split(",") if p]
    try:
        for label in args.policies:
            parse_variant(label)
    except ValueError as exc:
        parser.error(str(exc))
    args.rates = sorted(float(r) for r in args.rates.split(",") if r)
    if not args.policies or not args.rates or min(args.rates) <= 0 or args.adapters < 1 or args.rounds < 1:
        parser.error("need at least one policy, positive rates, >= 1 adapter and >= 1 round")
    if args.throttle_bytes_s < 0:
        parser.error("--throttle-bytes-s must be >= 0 (0: no throttle)")
    if args.model is not None:
        from loraplex.gpu_engine.model.config import ModelConfig

        try:  # the engine's own check, before any daemon starts
            ModelConfig.from_dir(args.model)
        except (OSError, ValueError) as exc:
            parser.error(f"--model {args.model}: {exc}")
    report = run(args)
    if args.json:
        print(json.dumps(report))
        return 0
    c = report["config"]
    print(f"{c['adapters']} adapters ({c['adapter_pages']} pages), pool {c['num_pages']} pages, "
          f"throttle {c['throttle_bytes_s']:.0e} B/s")
    print(f"{'rate':>6} {'policy':6} {'reqs':>5} {'hit':>6} {'mean':>8} {'p50':>8} {'p99':>8}  (TTFT ms)")
    for row in report["results"]:
        for name, r in row["policies"].items():
            t = r["ttft_ms"]
            print(f"{row['rate_rps']:>6} {name:6} {r['requests']:>5} {r['hit_rate'] or 0:>6.3f} {t['mean']:>8.1f} "
                  f"{t['p50']:>8.1f} {t['p99']:>8.1f}")
        print(f"{'':>6} p99 ratios: {row['p99_ttft_ratio']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
