"""Daemon overhead figures (issue: daemon, ZeroMQ/msgpack protocol and client):

1. control-plane cost per step on the demo model: daemon<->engine round trip
   minus the engine's own compute, in microseconds and as % of step time, plus
   the daemon's scheduling/result-handling time per step;
2. client-to-first-token overhead beyond engine time: client-measured TTFT minus
   the engine compute of the step that produced the first token;
3. requests/s the daemon sustains with a stub engine that answers at once;
4. with `--stub-step-ms MS --batch B --context C` (`stub`): a stub engine process
   (bench/stub_engine_process.py: the real link, sockets and plan codec) that sleeps MS
   per step serves B concurrent requests with C-token prompts; per configuration, the
   interval between the starts of two decode steps and how much of it the engine waited
   for the daemon (`exposed_overhead_frac` = (interval - MS) / MS at p50), and the
   decode plan's size on the wire.

Every run starts its own daemon(s) in private runtime dirs. `--json` prints one
JSON object on stdout; progress goes to stderr.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from loraplex.ipc.client import AsyncClient, Client, LoraplexError

ROOT = Path(__file__).resolve().parent.parent
DEMO_KIND = "random"  # the demo model this benchmark serves (its adapters: DEMO_ADAPTERS)
DEMO_ADAPTERS = (None, "qv-r8", "attn-r16", "all-r32", "mlp-r64", "rslora-r16", "kdown-r8")


def _log(msg: str) -> None:
    print(f"[daemon_overhead] {msg}", file=sys.stderr, flush=True)


def _start(args: list[str], runtime_dir: Path, env: dict[str, str]) -> subprocess.Popen:
    proc = subprocess.Popen(args, env={**env, "LORAPLEX_RUNTIME_DIR": str(runtime_dir)},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"daemon exited with {proc.returncode}")
        try:
            with Client(runtime_dir=runtime_dir) as c:
                c.ping(timeout=1.0)
            return proc
        except LoraplexError:
            time.sleep(0.2)
    proc.kill()
    raise TimeoutError("daemon did not start")


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()


def measure_real(concurrency: int, max_tokens: int, ttft_samples: int, loop: str, env: dict[str, str]) -> dict:
    with tempfile.TemporaryDirectory(prefix="lpx-bench-") as tmp:
        rt = Path(tmp) / "rt"
        env = {**env, "LORAPLEX_SCHEDULER_OVERLAP": "true" if loop == "overlap" else "false"}
        # The random demo, whatever the caller's LORAPLEX_DEMO says: its adapters are the ones asked
        # for below, and the figures in RESULTS.md were taken on it.
        env = {**env, "LORAPLEX_STATE_DIR": str(Path(tmp) / "state"), "LORAPLEX_DEMO": DEMO_KIND}
        proc = _start([sys.executable, "-m", "loraplex.cli", "serve", "--num-pages", "2048"], rt, env)
        try:
            _log(f"{loop} loop, demo model: {concurrency} concurrent streams x {max_tokens} tokens")
            adapters = DEMO_ADAPTERS

            async def load() -> None:
                async with AsyncClient(runtime_dir=rt) as client:
                    await asyncio.gather(*[
                        client.generate([5 + i, 17, 99, 240], adapter=adapters[i % len(adapters)],
                                        max_tokens=max_tokens, temperature=0.0, ignore_eos=True, timeout=600)
                        for i in range(concurrency)])

            started = time.perf_counter()
            asyncio.run(load())
            load_s = time.perf_counter() - started
            with Client(runtime_dir=rt) as c:
                stats = c.stats()
                _log(f"{ttft_samples} sequential requests for client TTFT")
                overheads, client_ttfts, engine_first = [], [], []
                for i in range(ttft_samples):
                    started = time.perf_counter()
                    stream = c.stream([7, 8 + i % 50, 9] * 8, max_tokens=2, temperature=0.0, ignore_eos=True,
                                      timeout=120)
                    first = None
                    for chunk in stream:
                        if first is None and chunk.token_ids:
                            first = time.perf_counter()
                    result = stream.finished_result()
                    client_ms = ((first or time.perf_counter()) - started) * 1e3
                    engine_ms = float(result.timings.get("first_step_engine_ms", 0.0))
                    client_ttfts.append(client_ms)
                    engine_first.append(engine_ms)
                    overheads.append(client_ms - engine_ms)
        finally:
            _stop(proc)
    lat = stats["latency"]
    step_ms = lat["step_ms"]["p50"]
    engine_ms = lat["engine_ms"]["p50"]
    round_trip_us = stats["control_overhead_ms"] * 1e3
    return {
        "loop": loop,
        "streams": concurrency,
        "tokens_per_s": concurrency * max_tokens / load_s,  # the streams' output tokens over their wall time
        "steps": stats["steps"],
        "mean_batch_rows": stats["mean_batch_rows"],
        "step_ms_p50": step_ms,
        "engine_ms_p50": engine_ms,
        "control_round_trip_us_mean": round_trip_us,
        "control_round_trip_pct_of_step": 100.0 * stats["control_overhead_ms"] / max(1e-9, step_ms),
        "daemon_policy_ms_mean": stats["policy_ms_mean"],
        "daemon_policy_pct_of_step": 100.0 * stats["policy_ms_mean"] / max(1e-9, step_ms + stats["policy_ms_mean"]),
        "client_ttft_ms_median": statistics.median(client_ttfts),
        "first_step_engine_ms_median": statistics.median(engine_first),
        "client_ttft_overhead_ms_median": statistics.median(overheads),
        "client_ttft_overhead_ms_p90": sorted(overheads)[int(0.9 * (len(overheads) - 1))],
    }


def measure_stub(clients: int, requests: int, max_tokens: int, env: dict[str, str]) -> dict:
    with tempfile.TemporaryDirectory(prefix="lpx-bench-") as tmp:
        rt = Path(tmp) / "rt"
        env = {**env, "LORAPLEX_STATE_DIR": str(Path(tmp) / "state"), "PYTHONPATH": str(ROOT)}
        proc = _start([sys.executable, str(Path(__file__).resolve()), "--serve-stub"], rt, env)
        try:
            _log(f"stub engine: {clients} clients x {requests} requests, {max_tokens} tokens each")

            async def one_client(n: int) -> None:
                async with AsyncClient(runtime_dir=rt) as client:
                    for _ in range(n):
                        await client.generate([5, 6, 7], max_tokens=max_tokens, ignore_eos=True, timeout=120)

            async def load() -> float:
                started = time.perf_counter()
                await asyncio.gather(*[one_client(requests // clients) for _ in range(clients)])
                return time.perf_counter() - started

            elapsed = asyncio.run(load())
        finally:
            _stop(proc)
    done = (requests // clients) * clients
    return {"clients": clients, "requests": done, "max_tokens": max_tokens, "seconds": elapsed,
            "requests_per_s": done / elapsed, "tokens_per_s": done * max_tokens / elapsed}


STUB_DECODE_STEPS = 40  # decode steps at full batch measured per --stub-step-ms configuration
STUB_MAX_BATCHED_TOKENS = 8192
LOOPS = ("sync", "overlap")  # scheduler.overlap false, true


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * (len(ordered) - 1) + 0.5))]


def measure_stub_steps(batch: int, context: int, step_ms: float, decode_steps: int, loop: str,
                       env: dict[str, str]) -> dict:
    """B requests of C-token prompts at once against the sleeping stub engine process; what the
    decode steps with all B rows cost (each request decodes until the last one's prefill is done
    and then at least `decode_steps` more; the first `decode_steps` of them are measured)."""
    import random

    # Twice the steps asked for: the B requests reach the engine over a few steps (more on a loaded
    # host), and the full-batch steps are only those after the last one's prefill; the first
    # `decode_steps` of them are measured.
    decode_tokens = 2 * decode_steps + -(-batch * context // STUB_MAX_BATCHED_TOKENS) + 2

    with tempfile.TemporaryDirectory(prefix="lpx-bench-") as tmp:
        rt, stats_path = Path(tmp) / "rt", Path(tmp) / "stub-stats.json"
        env = {**env, "LORAPLEX_STATE_DIR": str(Path(tmp) / "state"), "PYTHONPATH": str(ROOT),
               "LORAPLEX_STUB_STEP_MS": str(step_ms), "LORAPLEX_STUB_STATS": str(stats_path),
               "LORAPLEX_STUB_MAX_MODEL_LEN": str(context + decode_tokens + 16)}
        proc = _start([sys.executable, str(Path(__file__).resolve()), "--serve-stub-process", "--batch", str(batch),
                       "--loops", loop], rt, env)
        try:
            _log(f"{loop} loop, stub engine process, {step_ms:g} ms a step: {batch} requests of "
                 f"{context} prompt tokens, {decode_tokens} output tokens each")
            rng = random.Random(batch * 7919 + context)
            prompts = [[rng.randrange(3, 500) for _ in range(context)] for _ in range(batch)]

            async def load() -> None:
                async with AsyncClient(runtime_dir=rt) as client:
                    await asyncio.gather(*[client.generate(p, max_tokens=decode_tokens, ignore_eos=True, timeout=600)
                                           for p in prompts])

            asyncio.run(load())
        finally:
            _stop(proc)
        stats = json.loads(stats_path.read_text())
    full = [i for i, rows in enumerate(stats["decode_rows"]) if rows == batch]
    if not full:
        raise RuntimeError("the stub engine saw no two decode steps of the whole batch in a row")
    full = full[:decode_steps]
    intervals = [stats["decode_intervals_ms"][i] for i in full]
    interval = percentile(intervals, 0.5)
    return {"loop": loop, "batch": batch, "context": context, "step_ms": step_ms, "decode_steps": len(intervals),
            "step_interval_ms_p50": interval, "step_interval_ms_p90": percentile(intervals, 0.9),
            "exposed_overhead_ms_p50": interval - step_ms, "exposed_overhead_frac": (interval - step_ms) / step_ms,
            "plan_bytes_p50": percentile([stats["decode_plan_bytes"][i] for i in full], 0.5),
            # Of the exposed time, what the engine spent between the end of one step and the start
            # of the next (the rest: the stub's sleep overshooting, a busy host's scheduling).
            "engine_idle_ms_p50": percentile([stats["decode_idle_ms"][i] for i in full], 0.5)}


def serve_stub_process(batch: int, loop: str) -> int:
    sys.path.insert(0, str(ROOT))
    import uvloop

    from bench.stub_engine import StubProcessLink
    from loraplex.daemon.config_load import load_config
    from loraplex.daemon.main import run_daemon

    config = load_config(None, overrides={"scheduler.max_num_seqs": max(batch, 1),
                                           "scheduler.max_batched_tokens": max(STUB_MAX_BATCHED_TOKENS, batch),
                                           "scheduler.overlap": loop == "overlap"})
    return uvloop.run(run_daemon(config, engine_factory=StubProcessLink))


def serve_stub() -> int:
    sys.path.insert(0, str(ROOT))
    import uvloop

    from bench.stub_engine import StubEngineLink
    from loraplex.daemon.config_load import load_config
    from loraplex.daemon.main import run_daemon

    config = load_config(None, overrides={"scheduler.max_num_seqs": 256, "scheduler.max_batched_tokens": 4096})
    return uvloop.run(run_daemon(config, engine_factory=StubEngineLink))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--ttft-samples", type=int, default=20)
    parser.add_argument("--stub-clients", type=int, default=16)
    parser.add_argument("--stub-requests", type=int, default=2000)
    parser.add_argument("--stub-max-tokens", type=int, default=1)
    parser.add_argument("--stub-step-ms", type=float, nargs="+", default=[],
                        help="stub engine process sleeping this long per step (each value a configuration)")
    parser.add_argument("--batch", type=int, nargs="+", default=[64], help="--stub-step-ms: concurrent requests")
    parser.add_argument("--context", type=int, nargs="+", default=[2048], help="--stub-step-ms: prompt tokens")
    parser.add_argument("--stub-decode-steps", type=int, default=STUB_DECODE_STEPS,
                        help="--stub-step-ms: decode steps of the whole batch measured")
    parser.add_argument("--loops", nargs="+", choices=LOOPS, default=list(LOOPS),
                        help="which step loops to run side by side (scheduler.overlap false / true): the demo model "
                             "and each --stub-step-ms configuration")
    parser.add_argument("--stub-only", action="store_true", help="run only the --stub-step-ms configurations")
    parser.add_argument("--serve-stub", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--serve-stub-process", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_stub:
        return serve_stub()
    if args.serve_stub_process:
        return serve_stub_process(args.batch[0], args.loops[0])
    if args.stub_only and not args.stub_step_ms:
        parser.error("--stub-only needs --stub-step-ms")
    for name in ("batch", "context"):
        if min(getattr(args, name)) < 1:
            parser.error(f"--{name} must be >= 1")
    if any(ms <= 0 for ms in args.stub_step_ms) or args.stub_decode_steps < 2:
        parser.error("--stub-step-ms must be > 0 and --stub-decode-steps >= 2")
    env = dict(os.environ)
    report: dict = {
        "benchmark": "daemon_overhead",
        "env": {"python": sys.version.split()[0], "cpu_count": os.cpu_count(), "loadavg_1m": os.getloadavg()[0]},
    }
    if not args.stub_only:
        for loop in args.loops:  # demo_model: the first loop asked for (sync by default); demo_model_<loop>: the others
            key = "demo_model" if loop == args.loops[0] else f"demo_model_{loop}"
            report[key] = measure_real(args.concurrency, args.max_tokens, args.ttft_samples, loop, env)
        report["stub_engine"] = measure_stub(args.stub_clients, args.stub_requests, args.stub_max_tokens, env)
    if args.stub_step_ms:
        report["stub"] = [measure_stub_steps(b, c, ms, args.stub_decode_steps, loop, env)
                          for ms in args.stub_step_ms for b in args.batch for c in args.context for loop in args.loops]
    report["env"]["loadavg_1m_after"] = os.getloadavg()[0]
    if args.json:
        print(json.dumps(report))
    else:
        sections = [(s, report[s]) for s in ("demo_model", "demo_model_overlap", "stub_engine") if s in report]
        sections += [(f"stub {c['loop']} B={c['batch']} C={c['context']} MS={c['step_ms']:g}", c)
                     for c in report.get("stub", [])]
        for title, section in sections:
            print(title)
            for key, value in section.items():
                print(f"  {key:36s} {value:.3f}" if isinstance(value, float) else f"  {key:36s} {value}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
