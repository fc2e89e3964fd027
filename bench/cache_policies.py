"""Policy-level replay of the GPU adapter cache (Chameleon §5.3): hit rate and TTFT of the
none / lru / fifo / cost eviction policies, side by side on the same trace, at several loads.

No model and no GPU: the daemon's own AdapterResidency and PageAllocator run inside a
discrete-time model of an iteration-level FCFS server (continuous batching, KV reserved for
prompt + output at admission, no preemption, the adapters of the first queued requests
prefetched into free pages). A step takes step_ms + decode_ms_per_row·rows +
prefill_ms_per_token·prompt tokens, and with --stall step (default, the engine's stream
wait) it cannot start before the adapters of its prefill rows have loaded; a request's
first token comes at the end of its prefill step. Loads share one host->GPU link in
placement order at load_ms_per_page (default 2.5 ms per 8 MiB page, ~3.2 GB/s: pageable
host copies as in S-LoRA, Chameleon's baseline; pinned DMA is several times faster).
Workload: Poisson arrivals; adapter popularity Zipf, P(i) ∝ 1/i^s (s = --zipf, default 1.0);
ranks drawn uniformly from --ranks, pages = ceil(rank / rank_per_page) (a rank-r q/k/v/o
adapter of a 7B model is 2·r MiB, so rank/4 pages); prompt and output lengths from the
Azure LLM conv trace 2023 in trace order (its shifting lengths make the KV demand vary over
time), synthetic log-normal lengths when the trace is missing. Every rate replays the same
request sequences, only time-scaled; each seed draws its own ranks, popularity order,
arrivals and stretch of the trace, and reported figures are means over the seeds.
`--json` prints one JSON object on stdout; progress goes to stderr.
"""
from __future__ import annotations

import argparse
import csv
import json
import math
import random
import sys
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path

from loraplex.daemon.gpu_cache.policies import POLICY_NAMES, CostWeights
from loraplex.daemon.memory.adapter_residency import AdapterResidency
from loraplex.daemon.memory.allocator import KV, PageAllocator

_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_TRACE = next((p for p in (_ROOT / "shared" / "traces" / "AzureLLMInferenceTrace_conv.csv",
                                  _ROOT.parent / "shared" / "traces" / "AzureLLMInferenceTrace_conv.csv")
                      if p.is_file()), _ROOT.parent / "shared" / "traces" / "AzureLLMInferenceTrace_conv.csv")


@dataclass(frozen=True, slots=True)
class ServerModel:
    pool_pages: int = 3000
    page_tokens: int = 16
    rank_per_page: int = 4
    load_ms_per_page: float = 2.5
    step_ms: float = 12.0
    decode_ms_per_row: float = 0.4
    prefill_ms_per_token: float = 0.15
    max_num_seqs: int = 64
    max_batched_tokens: int = 4096
    max_model_len: int = 4096
    prefetch: bool = True
    prefetch_window: int = 32
    stall: str = "step"  # a load stalls the whole step ("step", the engine's stream wait) or only its row ("row")


@dataclass(slots=True)
class Request:
    arrival: float
    adapter: str
    prompt: int
    output: int
    kv: list[int] = field(default_factory=list)
    admitted: float = 0.0
    first_token: float | None = None
    left: int = 0  # decode steps still to run
    hit: bool = False
    load_wait: float = 0.0


def log(msg: str) -> None:
    print(f"[cache_policies] {msg}", file=sys.stderr, flush=True)


def read_lengths(path: Path | None, n: int, offset: int, rng: random.Random) -> tuple[list[tuple[int, int]], str]:
    """n (prompt, output) lengths from the trace in its order, starting at row `offset`."""
    if path is not None and path.is_file():
        with path.open(newline="") as f:
            rows = [(int(r["ContextTokens"]), int(r["GeneratedTokens"])) for r in csv.DictReader(f)]
        if rows:
            return [rows[(offset + i) % len(rows)] for i in range(n)], path.name
    # Synthetic: log-normal around the conv trace's medians (1020 prompt, 129 output tokens).
    return [(max(1, int(rng.lognormvariate(math.log(1020), 0.8))), max(1, int(rng.lognormvariate(math.log(129), 1.0))))
            for _ in range(n)], "synthetic"


def make_workload(args: argparse.Namespace, seed: int) -> tuple[dict[str, int], list[tuple[float, str, int, int]], str]:
    """Adapter ranks and a unit-rate request sequence (mean gap 1 s, to be divided by the rate);
    each seed draws its own ranks, popularity order, arrivals and stretch of the trace."""
    rng = random.Random(seed)
    names = [f"lora{i:04d}" for i in range(args.adapters)]
    ranks = {name: rng.choice(args.ranks) for name in names}
    weights = [1.0 / (i + 1) ** args.zipf for i in range(args.adapters)]
    lengths, source = read_lengths(args.trace, args.requests, seed * args.requests, rng)
    t, seq = 0.0, []
    for adapter, (prompt, output) in zip(rng.choices(names, weights, k=args.requests), lengths):
        t += rng.expovariate(1.0)
        seq.append((t, adapter, prompt, output))
    return ranks, seq, source


def simulate(policy: str, ranks: dict[str, int], seq: list[tuple[float, str, int, int]], rate: float,
             m: ServerModel, weights: CostWeights, warmup: float) -> dict[str, object]:
    now = 0.0
    alloc = PageAllocator(m.pool_pages)
    res = AdapterResidency(alloc, policy, weights=weights, clock=lambda: now)
    pages = {name: math.ceil(r / m.rank_per_page) for name, r in ranks.items()}
    pending: deque[Request] = deque()
    for t, adapter, prompt, output in seq:
        prompt = min(prompt, m.max_model_len - 1)
        pending.append(Request(t / rate, adapter, prompt, max(1, min(output, m.max_model_len - prompt))))
    all_reqs = list(pending)
    waiting: deque[Request] = deque()
    running: list[Request] = []
    ready_at: dict[str, float] = {}  # engine side: when each resident adapter's load completes
    link_free = link_busy = adapter_page_s = kv_page_s = 0.0
    kv_pages = pages_loaded = steps = 0
    while pending or waiting or running:
        while pending and pending[0].arrival <= now:
            waiting.append(pending.popleft())
        while waiting and len(running) < m.max_num_seqs:  # FCFS admission, as daemon/scheduler/fcfs.py
            r = waiting[0]
            hits = res.totals.hits
            if not res.acquire(r.adapter, pages[r.adapter]):
                break
            need = math.ceil((r.prompt + r.output) / m.page_tokens)
            if not res.make_room(need):
                res.release(r.adapter, backout=True)
                break
            r.kv, r.admitted, r.hit = alloc.allocate(need, KV), now, res.totals.hits > hits
            kv_pages += need
            running.append(waiting.popleft())
        res.set_queued(r.adapter for r in waiting)
        if m.prefetch and waiting:  # into free pages beyond what the head of the queue needs next
            head = waiting[0]
            reserve = math.ceil((head.prompt + head.output) / m.page_tokens)
            reserve += 0 if res.is_resident(head.adapter) else pages[head.adapter]
            window = dict.fromkeys(r.adapter for r in list(waiting)[:m.prefetch_window])
            res.prefetch(window, pages.__getitem__, alloc.num_free - reserve)
        changes = res.take_changes()  # the plan goes out: the engine evicts, then loads in order
        for name in changes.evict:
            ready_at.pop(name, None)
        for p in changes.place:
            load_s = len(p.pages) * m.load_ms_per_page / 1000.0
            link_free = max(now, link_free) + load_s
            ready_at[p.name] = link_free
            link_busy += load_s
            pages_loaded += len(p.pages)
            res.record_load_ms(p.name, load_s * 1000.0)
        decode = [r for r in running if r.first_token is not None]
        prefill: list[Request] = []
        budget = m.max_batched_tokens
        for r in running:
            stall_ok = m.stall == "step" or ready_at[r.adapter] <= now
            if r.first_token is None and stall_ok and (r.prompt <= budget or not prefill):
                prefill.append(r)
                budget -= r.prompt
        if not decode and not prefill:  # idle until the next arrival or load completion
            events = [ready_at[r.adapter] for r in running] + ([pending[0].arrival] if pending else [])
            if not events:
                raise RuntimeError("simulation stalled: a waiting request can never be admitted")
            now = max(now, min(events))
            continue
        start = max([now, *(ready_at[r.adapter] for r in prefill)])  # "step": the stream waits for the loads
        for r in prefill:
            r.load_wait = start - now
        adapter_page_s += (m.pool_pages - alloc.num_free - kv_pages) * (start - now)
        kv_page_s += kv_pages * (start - now)
        now = start
        dt = (m.step_ms + m.decode_ms_per_row * len(decode)
              + m.prefill_ms_per_token * sum(r.prompt for r in prefill)) / 1e3
        adapter_page_s += (m.pool_pages - alloc.num_free - kv_pages) * dt
        kv_page_s += kv_pages * dt
        now += dt
        steps += 1
        for r in prefill:
            r.first_token, r.left = now, r.output - 1
        for r in decode:
            r.left -= 1
        for r in [r for r in prefill + decode if r.left <= 0]:
            running.remove(r)
            alloc.free(r.kv)
            kv_pages -= len(r.kv)
            res.release(r.adapter)
    measured = all_reqs[int(len(all_reqs) * warmup):]
    ttft = sorted((r.first_token - r.arrival) * 1e3 for r in measured if r.first_token is not None)
    queue = sorted((r.admitted - r.arrival) * 1e3 for r in measured)
    totals = res.totals
    return {
        "hit_rate": sum(r.hit for r in measured) / len(measured),
        "hit_rate_all": totals.hit_rate(),
        "ttft_ms": {"p50": pct(ttft, 0.5), "p90": pct(ttft, 0.9), "p99": pct(ttft, 0.99),
                    "mean": sum(ttft) / len(ttft)},
        "queue_ms": {"p50": pct(queue, 0.5), "p99": pct(queue, 0.99)},
        "load_wait_ms_mean": 1e3 * sum(r.load_wait for r in measured) / len(measured),
        "loads": totals.loads, "pages_loaded": pages_loaded, "evictions": totals.evictions,
        "prefetches": totals.prefetches, "prefetch_hits": totals.prefetch_hits,
        "link_busy": link_busy / now if now else 0.0,
        "mean_cache_pages": adapter_page_s / now if now else 0.0, "mean_kv_pages": kv_page_s / now if now else 0.0,
        "throughput_rps": len(all_reqs) / now if now else 0.0, "sim_s": now, "steps": steps,
    }


def pct(values: list[float], q: float) -> float:
    """Nearest-rank percentile of sorted values."""
    return values[min(len(values) - 1, max(0, math.ceil(q * len(values)) - 1))] if values else 0.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    d = ServerModel()
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.add_argument("--adapters", type=int, default=200)
    p.add_argument("--requests", type=int, default=4000, help="requests per load level")
    p.add_argument("--zipf", type=float, default=1.0, help="popularity exponent s: P(i) ∝ 1/i^s")
    p.add_argument("--ranks", type=int, nargs="+", default=[8, 16, 32, 64, 128])
    p.add_argument("--rates", type=float, nargs="+", default=[1.5, 2.0, 2.4], help="arrival rates, req/s")
    p.add_argument("--policies", nargs="+", default=list(POLICY_NAMES), choices=POLICY_NAMES)
    p.add_argument("--trace", type=Path, default=DEFAULT_TRACE, help="Azure conv trace CSV (synthetic if missing)")
    p.add_argument("--warmup", type=float, default=0.1, help="share of the first requests left out of the stats")
    p.add_argument("--seed", type=int, default=0, help="first seed")
    p.add_argument("--seeds", type=int, default=3, help="seeds per point; results are means over them")
    p.add_argument("--no-prefetch", action="store_true", help="do not prefetch adapters of queued requests")
    p.add_argument("--stall", choices=("step", "row"), default="step",
                   help="a cold load stalls the whole step (engine stream wait) or only its own row")
    for name in ("pool_pages", "rank_per_page", "max_num_seqs"):
        p.add_argument(f"--{name.replace('_', '-')}", dest=name, type=int, default=getattr(d, name))
    for name in ("load_ms_per_page", "step_ms", "decode_ms_per_row", "prefill_ms_per_token"):
        p.add_argument(f"--{name.replace('_', '-')}", dest=name, type=float, default=getattr(d, name))
    args = p.parse_args(argv)
    if min(args.adapters, args.requests, args.seeds) <= 0 or min(args.rates) <= 0 or not 0 <= args.warmup < 1:
        p.error("--adapters, --requests, --seeds and --rates must be positive, --warmup in [0, 1)")
    return args


def mean_of(runs: list[dict[str, object]]) -> dict[str, object]:
    """Field-wise mean of the per-seed results (nested maps of numbers)."""
    out: dict[str, object] = {}
    for key, value in runs[0].items():
        if isinstance(value, dict):
            out[key] = mean_of([r[key] for r in runs])  # type: ignore[misc]
        else:
            values = [r[key] for r in runs]
            out[key] = None if None in values else sum(values) / len(values)  # type: ignore[arg-type]
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    model = ServerModel(pool_pages=args.pool_pages, rank_per_page=args.rank_per_page,
                        max_num_seqs=args.max_num_seqs, load_ms_per_page=args.load_ms_per_page,
                        step_ms=args.step_ms, decode_ms_per_row=args.decode_ms_per_row,
                        prefill_ms_per_token=args.prefill_ms_per_token, prefetch=not args.no_prefetch,
                        stall=args.stall)
    weights = CostWeights()
    seeds = list(range(args.seed, args.seed + args.seeds))
    workloads = [make_workload(args, seed) for seed in seeds]
    results: list[dict[str, object]] = []
    for rate in sorted(args.rates):
        policies: dict[str, dict[str, object]] = {}
        for policy in args.policies:
            started = time.perf_counter()
            runs = [simulate(policy, ranks, seq, rate, model, weights, args.warmup) for ranks, seq, _ in workloads]
            policies[policy] = {**mean_of(runs), "ttft_p99_ms_by_seed": [r["ttft_ms"]["p99"] for r in runs]}  # type: ignore[index]
            log(f"rate {rate:g} {policy}: {time.perf_counter() - started:.1f} s")
        p99 = {name: r["ttft_ms"]["p99"] for name, r in policies.items()}  # type: ignore[index]
        row: dict[str, object] = {"rate_rps": rate, "policies": policies}
        if "cost" in p99:
            row["cost_p99_over"] = {name: p99["cost"] / v for name, v in p99.items() if name != "cost" and v}
        results.append(row)
    report: dict[str, object] = {
        "benchmark": "cache_policies",
        "config": {"adapters": args.adapters, "requests": args.requests, "seeds": seeds, "zipf_exponent": args.zipf,
                   "ranks": args.ranks, "rates_rps": sorted(args.rates), "policies": args.policies,
                   "lengths": workloads[0][2], "warmup": args.warmup, "cost_weights": asdict(weights),
                   "server_model": asdict(model)},
        "results": results,
        "targets": targets(results),
    }
    if args.json:
        print(json.dumps(report, allow_nan=False))
    else:
        print_table(results)
    return 0


def targets(results: list[dict[str, object]]) -> dict[str, object]:
    """The issue's targets, checked on the mean P99 TTFT: cost <= lru at every rate, and
    cost <= 50% of none at the highest rate. None where a policy was not run."""
    ratios = [r.get("cost_p99_over", {}) for r in results]
    le_lru = [x["lru"] <= 1.0 for x in ratios if "lru" in x]  # type: ignore[index,operator]
    none_high = ratios[-1].get("none") if ratios else None  # type: ignore[union-attr]
    return {"cost_p99_le_lru_per_rate": le_lru or None,
            "cost_p99_le_half_none_at_highest_rate": None if none_high is None else none_high <= 0.5}


def print_table(results: list[dict[str, object]]) -> None:
    print(f"{'rate':>6} {'policy':>6} {'hit':>6} {'p50 ms':>9} {'p99 ms':>9} {'loads':>6} {'pages':>7} {'link':>6}")
    for row in results:
        for name, r in row["policies"].items():  # type: ignore[union-attr]
            t = r["ttft_ms"]
            print(f"{row['rate_rps']:>6g} {name:>6} {r['hit_rate']:>6.3f} {t['p50']:>9.1f} {t['p99']:>9.1f} "
                  f"{r['loads']:>6.0f} {r['pages_loaded']:>7.0f} {r['link_busy']:>6.2f}")


if __name__ == "__main__":
    sys.exit(main())
