"""Bounded soak test: N clients x M minutes against a real daemon.

Starts `loraplex serve` on the random CPU demo model (`ensure_demo_model()`, passed
with --model/--adapter, whatever LORAPLEX_DEMO says) in a private runtime directory
(cpu_assist with one CPU worker and cache policy `none` by default, so adapter
loads, shared-memory exchange and worker hand-offs churn all the time), then runs
N client threads, each with its own connection (reopened every
--reconnect-every requests), issuing a mix of non-streaming generates, streams
read to the end, streams abandoned after a chunk (the client cancels) and
explicit `cancel` messages. A sampler records the daemon's and its children's
RSS, open fds (/proc/PID/fd), threads and the instance's /dev/shm segments.

Reported per metric: `initial` (idle, before any request), `start` (first sample
after --warmup-s of load), `end` (idle again, --settle-s after the last request),
`max`, and `slope_per_min` (least squares over the loaded samples after
warm-up); plus requests ok / cancelled / failed, the daemon's exit status and the
segments left after it exits. `--json` prints one JSON object on stdout;
progress goes to stderr. Exit status 1 when any request failed (a soak is a
correctness check too), or when the daemon did not exit 0.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

from loraplex.ipc.client import Client, LoraplexError
from loraplex.ipc.runtime_dir import instance_id

KINDS = ("generate", "stream", "stream_abandon", "cancel")
KIND_WEIGHTS = (4, 3, 2, 1)
METRICS = ("rss_mib", "fds", "threads", "processes", "shm_segments")


def _log(msg: str) -> None:
    print(f"[soak] {msg}", file=sys.stderr, flush=True)


# -- sampling ----------------------------------------------------------------------------------

def descendants(pid: int) -> list[int]:
    """`pid` and every live process below it."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as fh:
                ppid = int(fh.read().rsplit(b")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, ()))
    return out


def _status(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/status") as fh:
        return dict(line.split(":", 1) for line in fh if ":" in line)


def _role(pid: int, root: int) -> str:
    """daemon, or the module a child runs (`engine_process`, `worker`, ...)."""
    if pid == root:
        return "daemon"
    with open(f"/proc/{pid}/cmdline", "rb") as fh:
        argv = fh.read().split(b"\0")
    module = argv[argv.index(b"-m") + 1].decode() if b"-m" in argv[:-1] else os.path.basename(argv[0].decode())
    return module.rsplit(".", 1)[-1]


def sample(pid: int, instance: str, started: float) -> dict:
    """One reading over the daemon's process tree; processes that exit meanwhile are skipped."""
    rss_kib = fds = threads = procs = 0
    by_role: Counter[str] = Counter()
    for p in descendants(pid):
        try:
            status = _status(p)
            n_fds = len(os.listdir(f"/proc/{p}/fd"))
            role = _role(p, pid)
        except (FileNotFoundError, ProcessLookupError):
            continue
        rss = int(status.get("VmRSS", "0 kB").split()[0])
        rss_kib += rss
        by_role[role] += rss
        threads += int(status.get("Threads", "0"))
        fds += n_fds
        procs += 1
    shm = sum(1 for name in os.listdir("/dev/shm") if name.startswith(f"lpx-{instance}-"))
    return {"t_s": round(time.monotonic() - started, 2), "rss_mib": round(rss_kib / 1024, 1), "fds": fds,
            "threads": threads, "processes": procs, "shm_segments": shm,
            "rss_mib_by_role": {role: round(kib / 1024, 1) for role, kib in sorted(by_role.items())}}


class Sampler(threading.Thread):
    def __init__(self, pid: int, instance: str, started: float, interval_s: float) -> None:
        super().__init__(name="soak-sampler", daemon=True)
        self.pid, self.instance, self.started, self.interval_s = pid, instance, started, interval_s
        self.samples: list[dict[str, float]] = []
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.wait(self.interval_s):
            self.samples.append(sample(self.pid, self.instance, self.started))

    def stop(self) -> None:
        self._halt.set()
        self.join()


# -- load ----------------------------------------------------------------------------------

class Tally:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.outcomes: Counter[str] = Counter()
        self.kinds: Counter[str] = Counter()
        self.errors: Counter[str] = Counter()
        self.tokens = 0

    def add(self, kind: str, outcome: str, tokens: int = 0, error: str | None = None) -> None:
        with self.lock:
            self.kinds[kind] += 1
            self.outcomes[outcome] += 1
            self.tokens += tokens
            if error:
                self.errors[error] += 1


def one_request(client: Client, rng: random.Random, kind: str, max_tokens: int, tally: Tally,
                adapters: tuple[str | None, ...]) -> None:
    prompt = [rng.randrange(3, 500) for _ in range(rng.randint(4, 24))]
    options = dict(adapter=rng.choice(adapters), max_tokens=rng.randint(2, max_tokens), temperature=0.8,
                   seed=rng.randrange(1 << 30), ignore_eos=True, timeout=120.0)
    try:
        if kind == "generate":
            result = client.generate(prompt, **options)
        elif kind == "stream":
            stream = client.stream(prompt, **options)
            for _ in stream:
                pass
            result = stream.finished_result()
        elif kind == "stream_abandon":  # read one chunk, then leave: the client sends `cancel`
            with client.stream(prompt, **options) as stream:
                next(stream, None)
            tally.add(kind, "cancelled")
            return
        else:  # an explicit cancel message, then the stream runs to its `done`
            stream = client.stream(prompt, **options)
            next(stream, None)
            client.cancel(stream.request_id)
            for _ in stream:
                pass
            result = stream.result
            if result is None:  # the one chunk read above was already the last
                tally.add(kind, "ok")
                return
    except LoraplexError as exc:
        tally.add(kind, "failed", error=exc.code.value)
        return
    outcome = "cancelled" if result.finish_reason == "cancelled" else "ok"
    tally.add(kind, outcome, tokens=len(result.token_ids))


def client_loop(index: int, runtime_dir: Path, deadline: float, args: argparse.Namespace, tally: Tally) -> None:
    rng = random.Random(args.seed * 1000 + index)
    client: Client | None = None
    sent = 0
    try:
        while time.monotonic() < deadline:
            if client is None or sent >= args.reconnect_every:
                if client is not None:
                    client.close()
                client, sent = Client(runtime_dir=runtime_dir), 0
            one_request(client, rng, rng.choices(KINDS, KIND_WEIGHTS)[0], args.max_tokens, tally, args.adapter_names)
            sent += 1
    finally:
        if client is not None:
            client.close()


# -- daemon ----------------------------------------------------------------------------------

def start_daemon(root: Path, serve_args: list[str]) -> tuple[subprocess.Popen, Path]:
    runtime_dir = root / "rt"
    env = {**os.environ, "LORAPLEX_RUNTIME_DIR": str(runtime_dir), "LORAPLEX_STATE_DIR": str(root / "state")}
    log = (root / "daemon.log").open("ab")
    proc = subprocess.Popen([sys.executable, "-m", "loraplex.cli", "serve", *serve_args], env=env, stdout=log,
                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"daemon exited with {proc.returncode}:\n{(root / 'daemon.log').read_text()}")
        if (runtime_dir / "client.sock").exists():
            try:
                with Client(runtime_dir=runtime_dir) as c:
                    c.ping(timeout=2.0)
                return proc, runtime_dir
            except LoraplexError:
                pass
        time.sleep(0.2)
    proc.kill()
    raise TimeoutError("daemon did not come up")


def stop_daemon(proc: subprocess.Popen) -> int:
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(90)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        return -9


# -- report ----------------------------------------------------------------------------------

def summarise(initial: dict, loaded: list[dict], end: dict, warmup_s: float) -> dict[str, dict[str, float]]:
    warm = [s for s in loaded if s["t_s"] >= warmup_s] or loaded[-1:] or [initial]
    out = {}
    for key in METRICS:
        series = [initial[key], *(s[key] for s in loaded), end[key]]
        slope = None
        if len(warm) >= 3 and warm[-1]["t_s"] > warm[0]["t_s"]:
            fit = statistics.linear_regression([s["t_s"] / 60 for s in warm], [float(s[key]) for s in warm])
            slope = round(fit.slope, 3)
        out[key] = {"initial": initial[key], "start": warm[0][key], "end": end[key], "max": max(series),
                    "slope_per_min": slope}
    out["rss_mib_by_role"] = {role: {"initial": initial["rss_mib_by_role"].get(role),
                                     "start": warm[0]["rss_mib_by_role"].get(role), "end": mib}
                              for role, mib in end["rss_mib_by_role"].items()}
    return out


def run(args: argparse.Namespace) -> dict:
    from loraplex.gpu_engine.demo import ensure_demo_model

    demo = ensure_demo_model()
    args.adapter_names = (None, *sorted(demo.adapters))  # the base model too
    model_args = ["--model", str(demo.model_dir)]
    for name, path in demo.adapters.items():
        model_args += ["--adapter", f"{name}={path}"]
    serve_args = [*model_args, "--num-pages", str(args.num_pages), "--max-num-seqs", "16",
                  "--adapter-load-mode", args.load_mode, "--cache-policy", args.cache_policy,
                  *(["--cpu-workers", "1"] if args.load_mode == "cpu_assist" else [])]
    loadavg_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="lpx-soak-") as tmp:
        root = Path(tmp)
        _log(f"starting the daemon: serve {' '.join(serve_args)}")
        started = time.monotonic()
        proc, runtime_dir = start_daemon(root, serve_args)
        startup_s = time.monotonic() - started
        instance = instance_id(runtime_dir)
        t0 = time.monotonic()
        try:
            initial = sample(proc.pid, instance, t0)
            sampler = Sampler(proc.pid, instance, t0, args.sample_s)
            sampler.start()
            tally = Tally()
            duration_s = args.minutes * 60
            _log(f"{args.clients} clients for {duration_s:.0f} s")
            deadline = time.monotonic() + duration_s
            workers = [threading.Thread(target=client_loop, args=(i, runtime_dir, deadline, args, tally))
                       for i in range(args.clients)]
            for w in workers:
                w.start()
            for w in workers:
                w.join()
            load_s = time.monotonic() - t0
            time.sleep(args.settle_s)
            sampler.stop()
            end = sample(proc.pid, instance, t0)
        finally:
            stopping = time.monotonic()
            exit_status = stop_daemon(proc)
            _log(f"daemon ready after {startup_s:.1f} s, stopped in {time.monotonic() - stopping:.1f} s")
        shm_left = sorted(n for n in os.listdir("/dev/shm") if n.startswith(f"lpx-{instance}-"))
        log_tail = (root / "daemon.log").read_text(errors="replace").splitlines()[-20:]
    loaded = [s for s in sampler.samples if s["t_s"] <= load_s]
    total = sum(tally.outcomes.values())
    return {
        "config": {"clients": args.clients, "minutes": args.minutes, "max_tokens": args.max_tokens,
                   "reconnect_every": args.reconnect_every, "sample_s": args.sample_s, "warmup_s": args.warmup_s,
                   "settle_s": args.settle_s, "serve_args": serve_args, "seed": args.seed,
                   "kind_weights": dict(zip(KINDS, KIND_WEIGHTS))},
        "requests": {"total": total, "ok": tally.outcomes["ok"], "cancelled": tally.outcomes["cancelled"],
                     "failed": tally.outcomes["failed"], "errors": dict(tally.errors), "by_kind": dict(tally.kinds),
                     "tokens": tally.tokens, "per_s": round(total / load_s, 2) if load_s else 0.0},
        "metrics": summarise(initial, loaded, end, args.warmup_s),
        "daemon_exit_status": exit_status,
        "daemon_startup_s": round(startup_s, 2),
        "shm_segments_after_exit": shm_left,
        "samples": [initial, *loaded, end],
        "environment": {"device": "cpu", "cpu_count": os.cpu_count(), "python": platform.python_version(),
                        "loadavg_1m_before": loadavg_before, "loadavg_1m_after": os.getloadavg()[0]},
        "daemon_log_tail": log_tail if exit_status != 0 else [],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=2, help="concurrent client threads (default 2)")
    parser.add_argument("--minutes", type=float, default=0.5, help="minutes of load (default 0.5)")
    parser.add_argument("--max-tokens", type=int, default=12, help="largest max_tokens of a request (default 12)")
    parser.add_argument("--reconnect-every", type=int, default=20, help="requests per client connection (default 20)")
    parser.add_argument("--sample-s", type=float, default=1.0, help="seconds between samples (default 1)")
    parser.add_argument("--warmup-s", type=float, default=None,
                        help="seconds of load before `start` (default: 20%% of the run, at most 30)")
    parser.add_argument("--settle-s", type=float, default=2.0, help="idle seconds before the `end` sample")
    parser.add_argument("--load-mode", default="cpu_assist", help="--adapter-load-mode of the daemon")
    parser.add_argument("--cache-policy", default="none", help="--cache-policy of the daemon (none: most churn)")
    parser.add_argument("--num-pages", type=int, default=600)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    args = parser.parse_args(argv)
    if args.clients < 1 or args.minutes <= 0:
        parser.error("--clients must be >= 1 and --minutes > 0")
    if args.warmup_s is None:
        args.warmup_s = min(30.0, args.minutes * 60 * 0.2)
    report = run(args)
    healthy = report["requests"]["failed"] == 0 and report["daemon_exit_status"] == 0
    if args.json:
        print(json.dumps(report))
        return 0 if healthy else 1
    r = report["requests"]
    print(f"requests: {r['total']} ({r['per_s']}/s): ok {r['ok']}, cancelled {r['cancelled']}, failed {r['failed']} "
          f"{r['errors'] or ''}")
    print(f"{'metric':14} {'initial':>9} {'start':>9} {'end':>9} {'max':>9} {'slope/min':>10}")
    for key in METRICS:
        m = report["metrics"][key]
        print(f"{key:14} {m['initial']:>9} {m['start']:>9} {m['end']:>9} {m['max']:>9} {str(m['slope_per_min']):>10}")
    for role, m in report["metrics"]["rss_mib_by_role"].items():
        print(f"  rss {role:14} {m['initial']:>5} {m['start']:>9} {m['end']:>9}")
    print(f"daemon exit {report['daemon_exit_status']}, shm segments left {len(report['shm_segments_after_exit'])}")
    return 0 if healthy else 1


if __name__ == "__main__":
    raise SystemExit(main())
