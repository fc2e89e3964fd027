"""One client must never stall another: a streaming client's inter-token gaps on the
CPU demo model, alone and while flood clients send huge text prompts.

Starts `loraplex serve` on the random demo model in a private runtime directory, warms the
engine up (its first steps are slow), then streams one greedy request twice: alone for
`--stream-s` seconds, and while `--clients` connections each send `--requests` text prompts of
`--prompt-bytes` bytes (random words) at once and wait for the replies, one round (the issue's
attack) or round after round for `--flood-s` seconds, from a separate process so the flood's
CPU time and GIL are not this one's. Reported per phase: the stream's largest, p99 and median
gap between tokens (ms; the window's ends count, so a stall until the end shows) and tokens
received; for the flood the replies by error code, rounds and seconds; the daemon's RSS before
and after the flood; the host's 1-minute load average before and after; `os.cpu_count()`.

`--flood ENDPOINT` runs only the flood clients against a running daemon and prints their
outcome as one JSON object (the hardening test uses it). `--json` prints one JSON object on
stdout; progress goes to stderr.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

from soak import start_daemon, stop_daemon

from loraplex.ipc.client import Client, LoraplexError

PROMPT_BYTES = 3_000_000
STREAM_PROMPT = [11, 12, 13, 14]


def _log(msg: str) -> None:
    print(f"[flood_gap] {msg}", file=sys.stderr, flush=True)


# -- the flood (its own process) --------------------------------------------------------------------------

def _words(size: int, rng: random.Random) -> str:
    """`size` characters of random lowercase words: text a tokenizer must really work on."""
    chunk = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz      ") for _ in range(4096))
    return (chunk * (size // len(chunk) + 1))[:size]


def flood(endpoint: str, clients: int, per_client: int, prompt_bytes: int, timeout_s: float,
          duration_s: float = 0.0, seed: int = 0) -> dict[str, object]:
    """`clients` connections each send `per_client` text prompts at once and wait for every
    reply; again and again until `duration_s` has passed (one round at least)."""
    import zmq

    from loraplex.ipc.codec import decode, encode
    from loraplex.ipc.protocol import GenerateRequest

    codes: Counter[str] = Counter()
    lock = threading.Lock()
    ctx = zmq.Context()
    rng = random.Random(seed)
    prompts = [_words(prompt_bytes, rng) for _ in range(min(per_client, 4))]
    started = time.monotonic()
    rounds = [0] * clients

    def one_round(sock, index: int) -> None:
        for i in range(per_client):
            sock.send(encode(GenerateRequest(request_id=f"flood-{index}-{rounds[index]}-{i}",
                                             prompt=prompts[i % len(prompts)], max_tokens=4, ignore_eos=True)))
        got, deadline = 0, time.monotonic() + timeout_s
        while got < per_client:
            left = deadline - time.monotonic()
            if left <= 0 or not sock.poll(int(left * 1000)):
                with lock:
                    codes["no_reply"] += per_client - got
                return
            reply = decode(sock.recv())
            if reply.TYPE == "pong":  # the daemon's liveness probe
                continue
            got += 1
            with lock:
                codes[getattr(reply, "code", reply.TYPE)] += 1

    def one(index: int) -> None:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(endpoint)
        try:
            while True:
                one_round(sock, index)
                rounds[index] += 1
                if time.monotonic() - started >= duration_s:
                    return
        finally:
            sock.close()

    threads = [threading.Thread(target=one, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    ctx.term()
    return {"codes": dict(codes), "requests": per_client * sum(rounds), "rounds": sum(rounds),
            "seconds": round(time.monotonic() - started, 3)}


def start_flood(endpoint: str, clients: int, per_client: int, prompt_bytes: int,
                timeout_s: float, duration_s: float = 0.0) -> subprocess.Popen:
    """This script's --flood mode in a child process; its stdout is the outcome's JSON."""
    return subprocess.Popen([sys.executable, __file__, "--flood", endpoint, "--clients", str(clients),
                             "--requests", str(per_client), "--prompt-bytes", str(prompt_bytes),
                             "--flood-timeout", str(timeout_s), "--flood-s", str(duration_s)],
                            stdout=subprocess.PIPE, text=True)


# -- the measuring side -----------------------------------------------------------------------------------

@contextlib.contextmanager
def frozen_heap():
    """Measure gaps with the process's objects so far out of the collector's reach (gc.freeze): in a
    test process holding a large heap, one full collection paused the thread that timestamps the
    tokens for over a second, which read as the daemon stalling the stream."""
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


class GapStream(threading.Thread):
    """One greedy streaming request; the arrival time of every chunk carrying tokens."""

    def __init__(self, client: Client, max_tokens: int) -> None:
        super().__init__(daemon=True)
        self.client, self.max_tokens = client, max_tokens
        self.times: list[float] = []
        self.first = threading.Event()
        self.stop = threading.Event()
        self.error: str | None = None

    def run(self) -> None:
        try:
            with self.client.stream(STREAM_PROMPT, max_tokens=self.max_tokens, temperature=0.0, ignore_eos=True,
                                    timeout=120) as stream:
                for chunk in stream:
                    if chunk.token_ids:
                        self.times.append(time.monotonic())
                        self.first.set()
                    if self.stop.is_set():
                        break
        except LoraplexError as exc:
            self.error = exc.code.value
        finally:
            self.first.set()

    def gaps_ms(self, since: float, until: float) -> list[float]:
        """Gaps between tokens in [since, until], the window's ends counting as tokens: a stream
        that stalls until the window closes shows the stall."""
        times = [since, *(t for t in self.times if since < t < until), until]
        return [(b - a) * 1e3 for a, b in zip(times, times[1:])]


def gap_summary(gaps: list[float]) -> dict[str, float | int | None]:
    if not gaps:
        return {"tokens": 0, "max_gap_ms": None, "p99_gap_ms": None, "median_gap_ms": None}
    ordered = sorted(gaps)
    p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
    return {"tokens": len(gaps) - 1, "max_gap_ms": round(ordered[-1], 2), "p99_gap_ms": round(p99, 2),
            "median_gap_ms": round(statistics.median(ordered), 2)}


def warm_up(runtime_dir: Path) -> None:
    """The engine's first steps are slow (allocator, kernels' first calls): not what is measured."""
    with Client(runtime_dir=runtime_dir) as client:
        client.generate(STREAM_PROMPT, max_tokens=64, temperature=0.0, ignore_eos=True, timeout=120)


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as fh:
        kib = next(int(line.split()[1]) for line in fh if line.startswith("VmRSS:"))
    return round(kib / 1024, 1)


def measure(runtime_dir: Path, args: argparse.Namespace, flooding: bool) -> dict[str, object]:
    """Stream for `stream_s` seconds, or while the flood runs when `flooding`."""
    with Client(runtime_dir=runtime_dir) as client:
        stream = GapStream(client, args.max_tokens)
        stream.start()
        stream.first.wait(60)
        since = time.monotonic()
        outcome = None
        if flooding:
            child = start_flood(f"ipc://{runtime_dir}/client.sock", args.clients, args.requests, args.prompt_bytes,
                                args.flood_timeout, duration_s=args.flood_s)
            out, _ = child.communicate(timeout=args.flood_s + args.flood_timeout + 60)
            outcome = json.loads(out)
        else:
            time.sleep(args.stream_s)
        until = time.monotonic()
        stream.stop.set()
        stream.join(60)
    report: dict[str, object] = {**gap_summary(stream.gaps_ms(since, until)), "seconds": round(until - since, 2),
                                 "stream_error": stream.error}
    if outcome is not None:
        report["flood"] = outcome
    return report


def run(args: argparse.Namespace) -> dict[str, object]:
    from loraplex.gpu_engine.demo import ensure_demo_model

    os.environ.setdefault("LORAPLEX_DEMO", "random")
    demo = ensure_demo_model()
    serve_args = ["--model", str(demo.model_dir), "--num-pages", "600", "--max-num-seqs", "16"]
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="lpx-flood-") as tmp:
        proc, runtime_dir = start_daemon(Path(tmp), serve_args)
        try:
            warm_up(runtime_dir)
            _log("stream alone")
            alone = measure(runtime_dir, args, flooding=False)
            rss_before = rss_mib(proc.pid)
            _log(f"stream with {args.clients} clients x {args.requests} prompts of {args.prompt_bytes} bytes")
            flooded = measure(runtime_dir, args, flooding=True)
            rss_after = rss_mib(proc.pid)
            with Client(runtime_dir=runtime_dir) as client:
                healthy = client.ping(timeout=5.0) < 5.0
        finally:
            exit_status = stop_daemon(proc)
    return {
        "benchmark": "flood_gap",
        "config": {"clients": args.clients, "requests_per_client": args.requests, "prompt_bytes": args.prompt_bytes,
                   "flood_s": args.flood_s, "stream_s": args.stream_s, "max_tokens": args.max_tokens,
                   "serve_args": serve_args},
        "alone": alone,
        "flooded": flooded,
        "daemon": {"rss_mib_before_flood": rss_before, "rss_mib_after_flood": rss_after, "healthy_after": healthy,
                   "exit_status": exit_status},
        "env": {"device": "cpu", "cpu_count": os.cpu_count(), "loadavg_1m_before": load_before,
                "loadavg_1m_after": os.getloadavg()[0]},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=4, help="flood connections (default 4)")
    parser.add_argument("--requests", type=int, default=20, help="prompts each flood connection sends (default 20)")
    parser.add_argument("--prompt-bytes", type=int, default=PROMPT_BYTES, help="size of each flood prompt")
    parser.add_argument("--stream-s", type=float, default=5.0, help="seconds the stream is measured alone")
    parser.add_argument("--flood-s", type=float, default=0.0,
                        help="seconds the flood repeats its rounds (default 0: one round, the issue's attack)")
    parser.add_argument("--max-tokens", type=int, default=4000, help="the stream's max_tokens (it is cut when done)")
    parser.add_argument("--flood-timeout", type=float, default=60.0, help="seconds a flood client waits for replies")
    parser.add_argument("--flood", metavar="ENDPOINT", help="only run the flood clients against ENDPOINT")
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    args = parser.parse_args(argv)
    if args.flood:
        outcome = flood(args.flood, args.clients, args.requests, args.prompt_bytes, args.flood_timeout,
                        duration_s=args.flood_s)
        sys.stdout.write(json.dumps(outcome) + "\n")
        return 0
    report = run(args)
    if args.json:
        sys.stdout.write(json.dumps(report) + "\n")
    else:
        for phase in ("alone", "flooded"):
            r = report[phase]
            sys.stdout.write(f"{phase:8s} tokens {r['tokens']:5d}  max gap {r['max_gap_ms']} ms  "
                             f"p99 gap {r['p99_gap_ms']} ms\n")
        sys.stdout.write(f"flood: {report['flooded'].get('flood')}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
