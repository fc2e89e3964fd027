"""Per-layer invocation round trip between one sender and N receiver processes
(Toppings Fig. 12): the sender signals "layer ready", every receiver answers
"done", the sender waits for all N answers. Three transports side by side:

- shm_futex: a sequence word and a done word in a loraplex SharedSegment;
  store_and_wake / wait_until_at_least / add_and_wake from loraplex._C
  (spin, then futex wait);
- zmq: one PUB to N SUB sockets, answers through PUSH -> one PULL (ipc://);
- uds: a Unix socketpair per receiver, 8-byte messages both ways.

Receivers are spawned processes pinned to distinct cores where the host has
them. `--json` prints one JSON object on stdout; progress goes to stderr.
"""
from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
import platform
import socket
import struct
import sys
import tempfile
import time
from contextlib import suppress
from pathlib import Path

from loraplex import _C
from loraplex.ipc.shm import HEADER_BYTES, SharedSegment, segment_name

VARIANTS = ("shm_futex", "zmq", "uds")
DEFAULT_RECEIVERS = (1, 2, 4)
START_TIMEOUT_S = 60.0
ROUND_TIMEOUT_MS = 5000.0
# Words of the shm variant, each on its own cache line after the segment header.
SEQ_WORD = HEADER_BYTES // 8
DONE_WORD = SEQ_WORD + 8
STARTED_WORD = SEQ_WORD + 16
SHM_BYTES = HEADER_BYTES + 3 * 64
_U64 = struct.Struct("<Q")
_ACK = struct.Struct("<QQ")  # seq, receiver id


def _log(msg: str) -> None:
    print(f"[ipc_roundtrip] {msg}", file=sys.stderr, flush=True)


def _pin(cpu: int | None) -> None:
    if cpu is not None and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {cpu})


def _usable_cpus() -> list[int]:
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def plan_pinning(receivers: int, cpus: list[int]) -> tuple[int | None, list[int | None]]:
    """(sender cpu, receiver cpus): everyone on its own core when there are enough;
    otherwise receivers on distinct cores as far as they go and the sender unpinned."""
    if len(cpus) <= 1:
        return None, [None] * receivers
    if receivers + 1 <= len(cpus):
        return cpus[0], cpus[1:receivers + 1]
    return None, [cpus[k % len(cpus)] for k in range(receivers)]


# -- receivers (run in spawned processes) ----------------------------------------------


def _shm_receiver(name: str, rounds: int, spin_us: float, cpu: int | None) -> None:
    _pin(cpu)
    seg = SharedSegment.attach(name)
    buf = seg.buf
    try:
        _C.add_and_wake(buf, STARTED_WORD, 1)
        for seq in range(1, rounds + 1):
            if not _C.wait_until_at_least(buf, SEQ_WORD, seq, ROUND_TIMEOUT_MS, spin_us):
                raise SystemExit(f"shm receiver: no round {seq} within {ROUND_TIMEOUT_MS} ms")
            _C.add_and_wake(buf, DONE_WORD, 1)
    finally:
        del buf
        seg.close()


def _zmq_receiver(pub: str, pull: str, ident: int, rounds: int, cpu: int | None) -> None:
    import zmq

    _pin(cpu)
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.RCVTIMEO, int(ROUND_TIMEOUT_MS))
    sub.connect(pub)
    push = ctx.socket(zmq.PUSH)
    push.connect(pull)
    try:
        while True:
            (seq,) = _U64.unpack(sub.recv())
            push.send(_ACK.pack(seq, ident))
            if seq == rounds:
                break
    finally:
        sub.close(0)
        push.close(0)
        ctx.term()


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError("peer closed the socket")
        data += chunk
    return data


def _uds_receiver(sock: socket.socket, rounds: int, cpu: int | None) -> None:
    _pin(cpu)
    sock.settimeout(ROUND_TIMEOUT_MS / 1000)
    with sock:
        sock.sendall(_U64.pack(0))  # started
        for _ in range(rounds):
            sock.sendall(_recv_exact(sock, 8))


# -- senders (this process) ------------------------------------------------------------


def _percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile of an ascending list."""
    return sorted_values[max(0, math.ceil(q * len(sorted_values)) - 1)]


def _summary(samples_ns: list[int]) -> dict[str, float]:
    us = sorted(s / 1000 for s in samples_ns)
    return {
        "p50_us": round(_percentile(us, 0.50), 2),
        "p90_us": round(_percentile(us, 0.90), 2),
        "p99_us": round(_percentile(us, 0.99), 2),
        "mean_us": round(sum(us) / len(us), 2),
        "min_us": round(us[0], 2),
        "max_us": round(us[-1], 2),
    }


def _wait_started(procs: list[multiprocessing.Process], ready) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while not ready():
        if any(p.exitcode is not None for p in procs) or time.monotonic() > deadline:
            raise RuntimeError("a receiver failed to start")
        time.sleep(0.001)


def run_shm(n: int, rounds: int, warmup: int, spin_us: float, pins: list[int | None], ctx) -> list[int]:
    seg = SharedSegment.create(segment_name(f"bench{os.getpid()}", "rt"), SHM_BYTES)
    buf = seg.buf
    procs = [ctx.Process(target=_shm_receiver, args=(seg.name, rounds, spin_us, pins[k]), daemon=True)
             for k in range(n)]
    samples: list[int] = []
    try:
        for p in procs:
            p.start()
        _wait_started(procs, lambda buf=buf: _C.atomic_load(buf, STARTED_WORD) >= n)
        for seq in range(1, rounds + 1):
            t0 = time.perf_counter_ns()
            _C.store_and_wake(buf, SEQ_WORD, seq)
            if not _C.wait_until_at_least(buf, DONE_WORD, seq * n, ROUND_TIMEOUT_MS, spin_us):
                raise RuntimeError(f"shm_futex: round {seq} not answered within {ROUND_TIMEOUT_MS} ms")
            if seq > warmup:
                samples.append(time.perf_counter_ns() - t0)
        _join(procs)
    finally:
        _reap(procs)
        del buf
        seg.close()
        seg.unlink()
    return samples


def run_zmq(n: int, rounds: int, warmup: int, pins: list[int | None], ctx) -> list[int]:
    import zmq

    zctx = zmq.Context()
    with tempfile.TemporaryDirectory(prefix="lpx-bench-") as tmp:
        pub_ep, pull_ep = f"ipc://{tmp}/pub", f"ipc://{tmp}/pull"
        pub = zctx.socket(zmq.PUB)
        pub.bind(pub_ep)
        pull = zctx.socket(zmq.PULL)
        pull.bind(pull_ep)
        procs = [ctx.Process(target=_zmq_receiver, args=(pub_ep, pull_ep, k, rounds, pins[k]), daemon=True)
                 for k in range(n)]
        samples: list[int] = []
        try:
            for p in procs:
                p.start()
            # PUB drops messages until a subscription arrives: publish seq 0 until every receiver answered it.
            synced: set[int] = set()
            deadline = time.monotonic() + START_TIMEOUT_S
            while len(synced) < n:
                if time.monotonic() > deadline or any(p.exitcode is not None for p in procs):
                    raise RuntimeError("zmq: receivers did not subscribe")
                pub.send(_U64.pack(0))
                while pull.poll(10):
                    seq, ident = _ACK.unpack(pull.recv())
                    if seq == 0:
                        synced.add(ident)
            for seq in range(1, rounds + 1):
                t0 = time.perf_counter_ns()
                pub.send(_U64.pack(seq))
                answered = 0
                while answered < n:
                    if not pull.poll(ROUND_TIMEOUT_MS):
                        raise RuntimeError(f"zmq: round {seq} not answered within {ROUND_TIMEOUT_MS} ms")
                    if _ACK.unpack(pull.recv())[0] == seq:  # late answers to sync probes are skipped
                        answered += 1
                if seq > warmup:
                    samples.append(time.perf_counter_ns() - t0)
            _join(procs)
        finally:
            _reap(procs)
            pub.close(0)
            pull.close(0)
            zctx.term()
    return samples


def run_uds(n: int, rounds: int, warmup: int, pins: list[int | None], ctx) -> list[int]:
    pairs = [socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM) for _ in range(n)]
    mine = [a for a, _ in pairs]
    procs = [ctx.Process(target=_uds_receiver, args=(b, rounds, pins[k]), daemon=True)
             for k, (_, b) in enumerate(pairs)]
    samples: list[int] = []
    try:
        for p in procs:
            p.start()
        for (_, theirs) in pairs:
            theirs.close()  # the child has its own copy now
        for s in mine:
            s.settimeout(START_TIMEOUT_S)
            _recv_exact(s, 8)
            s.settimeout(ROUND_TIMEOUT_MS / 1000)
        for seq in range(1, rounds + 1):
            t0 = time.perf_counter_ns()
            msg = _U64.pack(seq)
            for s in mine:
                s.sendall(msg)
            for s in mine:
                _recv_exact(s, 8)
            if seq > warmup:
                samples.append(time.perf_counter_ns() - t0)
        _join(procs)
    finally:
        _reap(procs)
        for s in mine:
            s.close()
    return samples


def _join(procs: list[multiprocessing.Process]) -> None:
    for p in procs:
        p.join(START_TIMEOUT_S)
        if p.exitcode != 0:
            raise RuntimeError(f"receiver exited with {p.exitcode}")


def _reap(procs: list[multiprocessing.Process]) -> None:
    for p in procs:
        if p.is_alive():
            p.kill()
        with suppress(ValueError, AssertionError):  # never started
            p.join(5)


def measure(variant: str, n: int, iters: int, warmup: int, spin_us: float) -> dict:
    ctx = multiprocessing.get_context("spawn")
    cpus = _usable_cpus()
    sender_cpu, pins = plan_pinning(n, cpus)
    previous = set(cpus)
    _pin(sender_cpu)
    try:
        rounds = warmup + iters
        if variant == "shm_futex":
            samples = run_shm(n, rounds, warmup, spin_us, pins, ctx)
        elif variant == "zmq":
            samples = run_zmq(n, rounds, warmup, pins, ctx)
        else:
            samples = run_uds(n, rounds, warmup, pins, ctx)
    finally:
        if sender_cpu is not None:
            os.sched_setaffinity(0, previous)
    return {"variant": variant, "receivers": n, "samples": len(samples), **_summary(samples),
            "sender_cpu": sender_cpu, "receiver_cpus": pins}


def _cpu_model() -> str:
    with suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def _loadavg() -> float | None:
    with suppress(OSError, AttributeError):
        return round(os.getloadavg()[0], 2)
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=2000, help="measured round trips per variant and N")
    parser.add_argument("--warmup", type=int, default=None, help="unmeasured rounds first (default: iters/10, >= 20)")
    parser.add_argument("--receivers", type=int, nargs="+", default=None,
                        help="receiver counts (default: 1 2 4, capped at the usable cores)")
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    parser.add_argument("--spin-us", type=float, default=50.0, help="spin before the futex wait (shm_futex)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    if args.iters < 1:
        parser.error("--iters must be >= 1")
    cpus = _usable_cpus()
    receivers = args.receivers or [n for n in DEFAULT_RECEIVERS if n <= len(cpus)] or [1]
    if any(n < 1 for n in receivers):
        parser.error("--receivers must be >= 1")
    warmup = args.warmup if args.warmup is not None else max(20, args.iters // 10)

    report: dict = {
        "bench": "ipc_roundtrip",
        "iters": args.iters,
        "warmup": warmup,
        "spin_us": args.spin_us,
        "host": {
            "cpu_model": _cpu_model(),
            "cpu_count": os.cpu_count(),
            "usable_cpus": cpus,
            "platform": platform.platform(),
            "python": platform.python_version(),
            "has_futex": _C.has_futex(),
            "loadavg_1m_before": _loadavg(),
        },
        "results": [],
    }
    for n in receivers:
        for variant in args.variants:
            _log(f"{variant}: {n} receiver(s), {warmup} + {args.iters} rounds")
            report["results"].append(measure(variant, n, args.iters, warmup, args.spin_us))
    report["host"]["loadavg_1m_after"] = _loadavg()
    at_two = [r for r in report["results"] if r["variant"] == "shm_futex" and r["receivers"] == 2]
    if at_two:
        report["target"] = {"shm_futex_p50_us_2_receivers": at_two[0]["p50_us"], "max_us": 100.0,
                            "met": at_two[0]["p50_us"] <= 100.0}

    if args.json:
        print(json.dumps(report))
    else:
        print(f"{'variant':<10} {'N':>3} {'p50 us':>9} {'p90 us':>9} {'p99 us':>9} {'mean us':>9}  pinning")
        for r in report["results"]:
            print(f"{r['variant']:<10} {r['receivers']:>3} {r['p50_us']:>9.1f} {r['p90_us']:>9.1f} "
                  f"{r['p99_us']:>9.1f} {r['mean_us']:>9.1f}  sender {r['sender_cpu']}, receivers {r['receiver_cpus']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
