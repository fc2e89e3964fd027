"""`loraplex bench serve`: drive a running daemon through the client library with
the simulator's workload spec, and report the simulator's metrics for it.

Torch-free. Requests are sent at their arrival times (open loop) and streamed,
so TTFT and time per token are measured at the client. The workload's adapter
names are mapped onto the daemon's registered adapters by popularity rank.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

from loraplex.daemon.sim.metrics import summarize
from loraplex.daemon.sim.profile import SimProfile
from loraplex.daemon.sim.simulator import RequestRecord, SimConfig, SimResult
from loraplex.daemon.sim.workload import RequestEvent, WorkloadSpec, generate, prompt_tokens
from loraplex.ipc.client import AsyncClient, LoraplexError


def map_adapters(events: list[RequestEvent], live: list[str]) -> dict[str, str | None]:
    """Workload adapter -> live adapter, most popular first (round-robin when fewer live ones)."""
    counts: dict[str, int] = {}
    for e in events:
        if e.adapter is not None:
            counts[e.adapter] = counts.get(e.adapter, 0) + 1
    ordered = sorted(counts, key=lambda a: (-counts[a], a))
    return {a: (live[i % len(live)] if live else None) for i, a in enumerate(ordered)}


async def _one(client: AsyncClient, event: RequestEvent, adapter: str | None, started: float,
               record: RequestRecord, vocab: int, timeout_s: float) -> None:
    await asyncio.sleep(max(0.0, started + event.arrival_s - time.perf_counter()))
    prompt = prompt_tokens(event.prompt_key, event.prompt_len, vocab)
    try:
        stream = client.stream(prompt, adapter=adapter, max_tokens=event.output_len, temperature=0.0,
                               ignore_eos=True, timeout=timeout_s)
        async for chunk in stream:
            if chunk.token_ids and record.first_token_s is None:
                record.first_token_s = time.perf_counter() - started
            record.output_tokens += len(chunk.token_ids)
        record.finish_s = time.perf_counter() - started
    except LoraplexError:
        record.aborted = True


async def drive(events: list[RequestEvent], *, runtime_dir: str | Path | None = None, vocab: int = 512,
                max_prompt: int = 2048, ttft_slo_ms: float = 2000.0, tpt_slo_ms: float = 100.0,
                timeout_s: float = 600.0) -> SimResult:
    async with AsyncClient(runtime_dir=runtime_dir) as client:
        live = sorted(a.name for a in await client.adapters() if a.state == "ready")
        mapping = map_adapters(events, live)
        before = await client.stats()
        records = [RequestRecord(event=e, engine=0) for e in events]
        started = time.perf_counter()
        await asyncio.gather(*[
            _one(client, RequestEvent(e.request_id, e.arrival_s, e.adapter, e.rank, min(e.prompt_len, max_prompt),
                                      max(1, e.output_len)),
                 None if e.adapter is None else mapping[e.adapter], started, r, vocab, timeout_s)
            for e, r in zip(events, records)])
        makespan = time.perf_counter() - started
        after = await client.stats()
    paths_before, paths_after = before.get("adapter_paths", {}), after.get("adapter_paths", {})
    delta = {k: int(paths_after.get(k, 0)) - int(paths_before.get(k, 0)) for k in paths_after}
    pcie_before = sum((before.get("pcie") or {}).get("total_bytes", {}).values())
    pcie_after = sum((after.get("pcie") or {}).get("total_bytes", {}).values())
    return SimResult(config=SimConfig(policy=str(after.get("scheduler", "fcfs")), ttft_slo_ms=ttft_slo_ms,
                                      tpt_slo_ms=tpt_slo_ms, mode=str(after.get("load_mode", "on_demand"))),
                     profile=SimProfile(), records=records, decisions=[], makespan_s=makespan,
                     pcie_bytes=pcie_after - pcie_before, cache_hits=delta.get("cached", 0) + delta.get("merged", 0),
                     cache_misses=delta.get("loaded", 0) + delta.get("cpu_assisted", 0),
                     steps=int(after.get("steps", 0)) - int(before.get("steps", 0)))


def configure(parser: argparse.ArgumentParser) -> None:
    w = WorkloadSpec()
    parser.add_argument("--runtime-dir", type=Path, default=None)
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    parser.add_argument("--seed", type=int, default=w.seed)
    parser.add_argument("--duration", type=float, default=10.0, help="seconds of arrivals")
    parser.add_argument("--max-requests", type=int, default=None)
    parser.add_argument("--arrival", default="poisson", help="poisson | gamma | trace")
    parser.add_argument("--rate", type=float, default=2.0, help="arrival rate, req/s")
    parser.add_argument("--cv", type=float, default=w.cv)
    parser.add_argument("--adapters", type=int, default=w.num_adapters,
                        help="workload adapters (mapped onto live ones)")
    parser.add_argument("--zipf", type=float, default=w.zipf_exponent)
    parser.add_argument("--lengths", default=w.lengths)
    parser.add_argument("--prompt-mean", type=int, default=64)
    parser.add_argument("--output-mean", type=int, default=32)
    parser.add_argument("--max-prompt", type=int, default=2048)
    parser.add_argument("--ttft-slo-ms", type=float, default=2000.0)
    parser.add_argument("--tpt-slo-ms", type=float, default=100.0)


def run(args: argparse.Namespace) -> int:
    spec = WorkloadSpec(seed=args.seed, duration_s=args.duration, max_requests=args.max_requests,
                        arrival=args.arrival, rate_rps=args.rate, cv=args.cv, num_adapters=args.adapters,
                        zipf_exponent=args.zipf, lengths=args.lengths, prompt_mean=args.prompt_mean,
                        output_mean=args.output_mean)
    events = generate(spec)
    print(f"bench serve: {len(events)} requests over {args.duration:.0f} s", file=sys.stderr)
    try:
        result = asyncio.run(drive(events, runtime_dir=args.runtime_dir, max_prompt=args.max_prompt,
                                   ttft_slo_ms=args.ttft_slo_ms, tpt_slo_ms=args.tpt_slo_ms))
    except LoraplexError as exc:
        print(f"loraplex bench serve: error: {exc}", file=sys.stderr)
        return 1
    row = summarize(result)
    row["label"] = "live"
    if args.json:
        print(json.dumps(row))
    else:
        for key, value in row.items():
            print(f"{key:24s} {value:.3f}" if isinstance(value, float) else f"{key:24s} {value}")
    return 0
