"""Request routers for loraplex on Ray Serve, side by side in one run: loraplex's (rank-aware
placement + adapter affinity, cluster/router.py), Ray Serve's default (power of two choices) and
Serve's multiplexing router (the adapter as multiplexed model id).

Writes --adapters random PEFT adapters (ranks drawn from 8, 16, 32, 64, 128 by the shared
workload generator) for the CPU demo model into a directory that is the cluster's
--adapter-source, so every replica resolves them on first use. Per router it starts
`loraplex cluster serve --replicas N` (a local Ray cluster on loopback), each daemon with a pool
of KV for a full batch plus --pool-fraction of all adapter pages (a replica cannot hold every
adapter; one whose router keeps an adapter's requests together can hold its share) and the
engine's test-only load throttle (a cold adapter costs tens of ms, like a PCIe copy), replays
the same seeded Poisson arrivals with Zipf adapter popularity (daemon.sim.workload) open loop
through the ingress as streamed /v1/completions (token-id prompts, ignore_eos), and stops it.

Per router: requests, completed, errors, GPU-tier hit rate (from the ingress's /metrics: the
daemons' adapter_paths, cached over cached + loaded + cpu_assisted), P50/P99 TTFT and mean TPT
at the client, and how the requests of the five most popular adapters spread over replicas.
`--json` prints one JSON object on stdout; progress goes to stderr.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from cache_live import adapter_pages, pool_size, write_adapters

from loraplex.contracts.host import free_loopback_port
from loraplex.daemon.sim.metrics import pct
from loraplex.daemon.sim.workload import WorkloadSpec, generate

ROUTERS = ("loraplex", "default", "multiplex")
MAX_NUM_SEQS = 16
START_TIMEOUT_S = 300.0


def _log(msg: str) -> None:
    print(f"[cluster] {msg}", file=sys.stderr, flush=True)



def _get(url: str, timeout: float = 10.0) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read()


class ClusterProcess:
    def __init__(self, home: Path, router: str, replicas: int, source: Path, daemon_args: list[str],
                 router_slo_ms: float | None = None) -> None:
        self.port = free_loopback_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = home / "cluster.log"
        argv = [sys.executable, "-m", "loraplex.cli", "cluster", "serve", "--replicas", str(replicas),
                "--http-port", str(self.port), "--router", router, "--adapter-source", str(source),
                "--log-level", "warning", *(f"--daemon-arg={a}" for a in daemon_args),
                *(["--router-slo-ms", str(router_slo_ms)] if router_slo_ms and router == "loraplex" else [])]
        with self.log_path.open("wb") as out:
            self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"})
        self.replicas = replicas

    def wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the cluster exited with {self.proc.returncode}:\n"
                                   f"{self.log_path.read_text(errors='replace')[-4000:]}")
            try:
                if len(json.loads(_get(self.url + "/v1/cluster/replicas"))["data"]) == self.replicas:
                    return
            except (OSError, ValueError):
                pass
            time.sleep(0.5)
        raise TimeoutError("the cluster did not come up")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def adapter_paths(url: str) -> dict[str, float]:
    """The daemons' finished requests by adapter path, summed by the ingress (/metrics)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(_get(url + "/metrics").decode()):
        if family.name == "loraplex_adapter_path_requests":
            for sample in family.samples:
                if sample.name.endswith("_total"):
                    out[sample.labels["path"]] = sample.value
    return out


async def one_request(session, url: str, event, vocab: int, started: float, out: list[dict]) -> None:
    import random

    await asyncio.sleep(max(0.0, started + event.arrival_s - time.monotonic()))
    rng = random.Random(event.request_id)
    body = {"model": event.adapter or "loraplex-base",
            "prompt": [rng.randrange(5, vocab) for _ in range(event.prompt_len)],
            "max_tokens": event.output_len, "temperature": 0.0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    sent = time.monotonic()
    first = last = None
    tokens, error = 0, None
    try:
        async with session.post(url + "/v1/completions", json=body) as resp:
            if resp.status != 200:
                error = f"HTTP {resp.status}"
            async for line in resp.content:
                if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                    continue
                msg = json.loads(line[6:])
                if "error" in msg:
                    error = msg["error"].get("code") or "error"
                    continue
                if msg.get("choices") and msg["choices"][0].get("text"):
                    last = time.monotonic()
                    first = first or last
                if msg.get("usage"):
                    tokens = msg["usage"]["completion_tokens"]
    except Exception as exc:  # counted, never fatal to the run
        error = type(exc).__name__
    out.append({"adapter": event.adapter, "error": error,
                "ttft_ms": None if first is None else (first - sent) * 1e3,
                "tpt_ms": None if first is None or tokens < 2 else (last - first) * 1e3 / (tokens - 1)})


async def drive(url: str, events: list, vocab: int) -> list[dict]:
    import aiohttp

    out: list[dict] = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        started = time.monotonic()
        await asyncio.gather(*(one_request(session, url, e, vocab, started, out) for e in events))
    return out


def spread(url: str, adapters: list[str]) -> dict[str, list[int]]:
    """Requests per replica for each of `adapters` (sorted counts, largest first)."""
    rows = json.loads(_get(url + "/v1/cluster/replicas"))["data"]
    return {a: sorted((int(r["requests_by_adapter"].get(a, 0)) for r in rows), reverse=True) for a in adapters}


def summarise(records: list[dict], paths: dict[str, float], top: dict[str, list[int]]) -> dict:
    done = [r for r in records if r["error"] is None and r["ttft_ms"] is not None]
    ttft = sorted(r["ttft_ms"] for r in done)
    tpt = [r["tpt_ms"] for r in done if r["tpt_ms"] is not None]
    hits = paths.get("cached", 0.0) + paths.get("merged", 0.0)
    misses = paths.get("loaded", 0.0) + paths.get("cpu_assisted", 0.0)
    return {"requests": len(records), "completed": len(done), "errors": len(records) - len(done),
            "gpu_hit_rate": round(hits / (hits + misses), 4) if hits + misses else None,
            "adapter_paths": paths,
            "ttft_ms": {"p50": round(pct(ttft, 0.5), 1), "p99": round(pct(ttft, 0.99), 1),
                        "mean": round(sum(ttft) / len(ttft), 1) if ttft else None},
            "tpt_ms_mean": round(sum(tpt) / len(tpt), 2) if tpt else None,
            "top_adapters_per_replica": top}


def run(args: argparse.Namespace) -> dict:
    from loraplex.gpu_engine.demo import ensure_demo_model
    from loraplex.gpu_engine.demo.model import demo_model_config

    model_dir = ensure_demo_model().model_dir
    model_config = demo_model_config()
    vocab = int(model_config["vocab_size"])
    spec = WorkloadSpec(seed=args.seed, duration_s=args.duration, rate_rps=args.rate, num_adapters=args.adapters,
                        zipf_exponent=args.zipf, prompt_mean=args.prompt_mean, output_mean=args.output_mean,
                        max_prompt=args.max_prompt, max_output=args.max_output)
    events = generate(spec)
    popular = [a for a, _ in sorted(((a, sum(e.adapter == a for e in events)) for a in {e.adapter for e in events
                                                                                        if e.adapter}),
                                    key=lambda kv: -kv[1])[:5]]
    os.environ["LORAPLEX_MODEL_LOAD_THROTTLE_BYTES_S"] = str(args.throttle_bytes_s)
    os.environ["OMP_NUM_THREADS"] = "1"  # torch's threads spin against the other replicas on a small host
    loadavg_before = os.getloadavg()[0]
    results, exits = {}, {}
    with tempfile.TemporaryDirectory(prefix="lpx-bench-cluster-") as tmp:
        root = Path(tmp)
        adapters = write_adapters(root / "adapters", spec, model_config)
        ranks = [rank for _, rank in adapters.values()]
        geometry, pages = adapter_pages(model_config, ranks)
        num_pages = pool_size(geometry, pages, args.pool_fraction, args.max_prompt + args.max_output)
        daemon_args = ["--model", str(model_dir), "--num-pages", str(num_pages), "--max-num-seqs", str(MAX_NUM_SEQS),
                       "--adapter-load-mode", "on_demand", "--device", "cpu"]
        _log(f"{len(adapters)} adapters, {sum(pages)} adapter pages, pool {num_pages} pages per replica, "
             f"{len(events)} requests at {args.rate} rps")
        for router in args.routers:
            home = root / router
            home.mkdir()
            _log(f"{router}: starting {args.replicas} replicas")
            cluster = ClusterProcess(home, router, args.replicas, root / "adapters", daemon_args, args.router_slo_ms)
            try:
                cluster.wait_ready()
                started = time.monotonic()
                records = asyncio.run(drive(cluster.url, events, vocab))
                time.sleep(1.5)  # every replica reports its daemon's stats to the board once more
                results[router] = summarise(records, adapter_paths(cluster.url), spread(cluster.url, popular))
                r = results[router]
                _log(f"{router}: {r['completed']}/{r['requests']} done in {time.monotonic() - started:.1f} s, hit "
                     f"rate {r['gpu_hit_rate']}, TTFT p50 {r['ttft_ms']['p50']} p99 {r['ttft_ms']['p99']} ms, "
                     f"TPT {r['tpt_ms_mean']} ms")
            finally:
                exits[router] = cluster.stop()
    return {
        "benchmark": "cluster",
        "config": {"replicas": args.replicas, "adapters": args.adapters, "ranks": dict(zip(adapters, ranks)),
                   "zipf_exponent": args.zipf, "rate_rps": args.rate, "duration_s": args.duration,
                   "requests": len(events), "num_pages_per_replica": num_pages, "pool_fraction": args.pool_fraction,
                   "throttle_bytes_s": args.throttle_bytes_s, "prompt_mean": args.prompt_mean,
                   "output_mean": args.output_mean, "routers": args.routers, "seed": args.seed,
                   "router_slo_ms": args.router_slo_ms},
        "results": results,
        "cluster_exit": exits,
        "environment": {"cpu_count": os.cpu_count(), "python": platform.python_version(),
                        "loadavg_1m_before": loadavg_before, "loadavg_1m_after": os.getloadavg()[0]},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--adapters", type=int, default=60)
    parser.add_argument("--routers", default=",".join(ROUTERS), help=f"comma-separated, of {', '.join(ROUTERS)}")
    parser.add_argument("--rate", type=float, default=3.0, help="arrivals per second")
    parser.add_argument("--duration", type=float, default=30.0, help="seconds of arrivals")
    parser.add_argument("--zipf", type=float, default=1.0)
    parser.add_argument("--pool-fraction", type=float, default=0.15,
                        help="share of all adapter pages one replica's pool holds besides KV (default 0.15)")
    parser.add_argument("--throttle-bytes-s", type=float, default=2e8,
                        help="adapter load bandwidth on CPU (default 2e8: rank 128 ~50 ms, rank 8 ~3 ms)")
    parser.add_argument("--prompt-mean", type=int, default=32)
    parser.add_argument("--output-mean", type=int, default=8)
    parser.add_argument("--max-prompt", type=int, default=128)
    parser.add_argument("--max-output", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--router-slo-ms", type=float, default=None,
                        help="the loraplex router's TPT SLO (default: its own, 36 ms, a GPU step's scale)")
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    args = parser.parse_args(argv)
    args.routers = [r for r in args.routers.split(",") if r]
    if not args.routers or set(args.routers) - set(ROUTERS):
        parser.error(f"--routers takes names of {', '.join(ROUTERS)}")
    if args.replicas < 1 or args.adapters < 1 or args.rate <= 0 or args.duration <= 0 or args.throttle_bytes_s < 0:
        parser.error("replicas, adapters, rate and duration must be positive, the throttle >= 0")
    report = run(args)
    if args.json:
        print(json.dumps(report))
        return 0
    for router, r in report["results"].items():
        print(f"{router:10} {r['completed']:>4}/{r['requests']:<4} hit {r['gpu_hit_rate']}  TTFT p50 "
              f"{r['ttft_ms']['p50']} p99 {r['ttft_ms']['p99']} ms  TPT {r['tpt_ms_mean']} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
