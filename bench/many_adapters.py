"""Many registered adapters: what N registered adapters cost a real daemon.

For each N in --counts: a fresh state directory; N tiny PEFT adapters (rank --rank on q_proj and
v_proj of the random CPU demo model), each its own directory of hard links to one written
adapter (so N costs no disk, but every adapter is a separate path the daemon reads and loads).
N - S of them are written straight into the registry under the model's scope (what a long-lived
daemon accumulated), then the daemon starts and the last S = min(N, --adds) are added through
the admin socket, timed one by one. Reported per N:
- add_ms p50/p99 over those S adds (registration with N already registered: hash, validate,
  host store, engines, registry);
- list_ms: median of --repeats `adapters()` calls (the whole list over the admin socket);
- ready_s: after a SIGTERM stop, spawn of `loraplex serve` to the first answered ping, median of
  --restarts restarts (registry of N, nothing read at start);
- rss_mib: daemon, cache manager and engine resident memory right after that ready, and again
  after the TTFT requests (the background warm-up fills the host store meanwhile);
- ttft_ms: after a few base requests (engine warm-up), cold (first request for an adapter not
  in the GPU pool, right after a restart; `cold_tiers` says whether it was on disk or in the host
  store then) and warm (the same adapter again, from the GPU pool), medians over
  --ttft-adapters adapters, and the base model's, all with a 4-token prompt and one output token;
- the host tier and adapter counts of `stats` at the end.
The goal is flat in N apart from the registry's own size. --small runs N = 10, 40 with few
repeats (the test). --json prints one JSON object on stdout; progress goes to stderr.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from loraplex.ipc.client import AdminClient, Client, LoraplexError

SMALL_COUNTS = (10, 40)
TARGETS = ["q_proj", "v_proj"]
FILES = ("adapter_config.json", "adapter_model.safetensors")
WARM_UP_REQUESTS = 8


def _log(msg: str) -> None:
    print(f"[many_adapters] {msg}", file=sys.stderr, flush=True)


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def _rss_mib(pid: int | None) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except (OSError, TypeError):
        return None
    return None


def write_adapters(root: Path, n: int, model_config: dict, rank: int) -> list[Path]:
    """One real adapter, then n directories of hard links to its files."""
    from loraplex.gpu_engine.demo.adapter import write_random_adapter

    source = root / "source"
    write_random_adapter(source, model_config, rank=rank, alpha=float(2 * rank), target_modules=TARGETS, seed=20)
    dirs = []
    for i in range(n):
        d = root / "adapters" / f"a{i:05d}"
        d.mkdir(parents=True)
        for name in FILES:
            os.link(source / name, d / name)
        dirs.append(d)
    return dirs


class Daemon:
    """One `loraplex serve` in a private runtime and state directory."""

    def __init__(self, root: Path, args: list[str]) -> None:
        self.root = root
        self.runtime_dir = root / "rt"
        self.env = {**os.environ, "LORAPLEX_RUNTIME_DIR": str(self.runtime_dir),
                    "LORAPLEX_STATE_DIR": str(root / "state"), "LORAPLEX_SERVER_SPARE_CHILDREN": "false"}
        self.args = args
        self.proc: subprocess.Popen | None = None

    def start(self, timeout_s: float = 300.0) -> float:
        """Spawn and wait for the first answered ping; the seconds that took."""
        log = (self.root / "daemon.log").open("ab")
        started = time.monotonic()
        self.proc = subprocess.Popen([sys.executable, "-m", "loraplex.cli", "serve", *self.args], env=self.env,
                                     stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        while time.monotonic() - started < timeout_s:
            if self.proc.poll() is not None:
                raise RuntimeError(f"daemon exited with {self.proc.returncode}; see {self.root / 'daemon.log'}")
            if (self.runtime_dir / "client.sock").exists():
                try:
                    with Client(runtime_dir=self.runtime_dir) as c:
                        c.ping(timeout=1.0)
                    return time.monotonic() - started
                except LoraplexError:
                    pass
            time.sleep(0.02)
        self.proc.kill()
        raise TimeoutError(f"daemon did not come up in {timeout_s} s")

    def stop(self) -> int:
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()

    def stats(self) -> dict:
        with Client(runtime_dir=self.runtime_dir) as c:
            return c.stats(timeout=60)

    def rss(self) -> dict[str, float | None]:
        s = self.stats()
        return {"daemon": _rss_mib(self.proc.pid), "cache_manager": _rss_mib((s.get("host_tier") or {}).get("pid")),
                "engine": _rss_mib((s.get("engine") or {}).get("pid"))}


def ttft_ms(runtime_dir: Path, adapter: str | None) -> float:
    with Client(runtime_dir=runtime_dir) as c:
        r = c.generate([5, 6, 7, 8], adapter=adapter, max_tokens=1, temperature=0.0, ignore_eos=True, timeout=120)
    return float(r.timings["ttft_ms"])


def one_count(n: int, args: argparse.Namespace, model_dir: Path, model_config: dict, tmp: Path) -> dict:
    from loraplex.daemon.model_scope import model_scope
    from loraplex.daemon.registry import AdapterRegistry

    root = tmp / f"n{n}"
    root.mkdir()
    dirs = write_adapters(root, n, model_config, args.rank)
    adds = min(n, args.adds)
    with AdapterRegistry(root / "state" / "registry.sqlite3", model=model_scope(model_dir)) as registry:
        for i, d in enumerate(dirs[:n - adds]):
            registry.add(f"a{i:05d}", str(d), source="cli")
    _log(f"N={n}: {n - adds} adapters written into the registry; starting the daemon")
    daemon = Daemon(root, ["--model", str(model_dir), "--device", "cpu", "--num-pages", str(args.num_pages),
                           "--max-num-seqs", "16", "--host-store-bytes", str(args.host_store_bytes)])
    first_ready = daemon.start()
    add_ms = []
    try:
        with AdminClient(runtime_dir=daemon.runtime_dir) as admin:
            for i in range(n - adds, n):
                started = time.perf_counter()
                admin.add_adapter(f"a{i:05d}", dirs[i], timeout=120)
                add_ms.append((time.perf_counter() - started) * 1e3)
            list_ms = []
            for _ in range(args.repeats):
                started = time.perf_counter()
                listed = admin.adapters(timeout=120)
                list_ms.append((time.perf_counter() - started) * 1e3)
        assert len(listed) == n, f"{len(listed)} adapters listed, {n} registered"
        _log(f"N={n}: {adds} adds p50 {_pct(add_ms, 0.5):.1f} ms, list {statistics.median(list_ms):.1f} ms")
        ready, rss_ready, rss_after, cold, warm, base, cold_tiers = [], None, None, [], [], [], []
        names = [f"a{i:05d}" for i in range(n)][-args.ttft_adapters:]  # warmed last: the coldest
        for restart in range(args.restarts):
            code = daemon.stop()
            if code != 0:
                raise RuntimeError(f"daemon stop exited {code}")
            ready.append(daemon.start())
            if restart == args.restarts - 1:
                rss_ready = daemon.rss()
                for _ in range(WARM_UP_REQUESTS):  # the engine's first steps are slow on any N
                    ttft_ms(daemon.runtime_dir, None)
                base = [ttft_ms(daemon.runtime_dir, None) for _ in range(3)]
                with AdminClient(runtime_dir=daemon.runtime_dir) as admin:
                    tiers = {a.name: a.extra.get("tier") for a in admin.adapters(timeout=120)}
                for name in names:
                    cold_tiers.append(tiers.get(name))
                    cold.append(ttft_ms(daemon.runtime_dir, name))
                    warm.append(ttft_ms(daemon.runtime_dir, name))
                rss_after = daemon.rss()
        _log(f"N={n}: ready {statistics.median(ready):.2f} s, cold TTFT {statistics.median(cold):.1f} ms, "
             f"warm {statistics.median(warm):.1f} ms")
        final = daemon.stats()
    finally:
        daemon.stop()
    host = final.get("host_tier") or {}
    return {
        "n": n, "adds_timed": adds, "first_start_s": first_ready,
        "add_ms": {"p50": _pct(add_ms, 0.5), "p99": _pct(add_ms, 0.99), "max": max(add_ms)},
        "list_ms": {"median": statistics.median(list_ms), "max": max(list_ms)},
        "ready_s": {"median": statistics.median(ready), "all": ready},
        "rss_mib": {"at_ready": rss_ready, "after_requests": rss_after},
        "ttft_ms": {"cold_median": statistics.median(cold), "warm_median": statistics.median(warm),
                    "base_median": statistics.median(base), "cold": cold, "warm": warm,
                    "cold_tiers": cold_tiers},
        "adapter_counts": final.get("adapter_counts"),
        "host_tier": {k: host.get(k) for k in ("capacity_bytes", "used_bytes", "adapters", "loads", "evictions")},
        "registry_bytes": (root / "state" / "registry.sqlite3").stat().st_size,
    }


def run(args: argparse.Namespace) -> dict:
    from loraplex.gpu_engine.demo import demo_model_config, ensure_demo_model

    counts = SMALL_COUNTS if args.small else tuple(args.counts)
    model_dir = Path(ensure_demo_model().model_dir)
    model_config = demo_model_config()
    results = []
    with tempfile.TemporaryDirectory(prefix="lpx-many-") as tmp:
        for n in counts:
            results.append(one_count(n, args, model_dir, model_config, Path(tmp)))
    return {
        "bench": "many_adapters",
        "config": {"counts": list(counts), "rank": args.rank, "targets": TARGETS, "adds": args.adds,
                   "restarts": args.restarts, "repeats": args.repeats, "ttft_adapters": args.ttft_adapters,
                   "host_store_bytes": args.host_store_bytes, "num_pages": args.num_pages, "model": "random demo"},
        "environment": {"python": platform.python_version(), "cpu_count": os.cpu_count(),
                        "loadavg_1m": os.getloadavg()[0]},
        "results": results,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--counts", type=int, nargs="+", default=[10, 1000, 10000], help="registered adapters per run")
    p.add_argument("--small", action="store_true", help=f"N = {SMALL_COUNTS}, few repeats (for the test)")
    p.add_argument("--rank", type=int, default=4)
    p.add_argument("--adds", type=int, default=200, help="adds timed through the admin socket (the last ones)")
    p.add_argument("--restarts", type=int, default=3)
    p.add_argument("--repeats", type=int, default=5, help="adapter list calls")
    p.add_argument("--ttft-adapters", type=int, default=5)
    p.add_argument("--host-store-bytes", type=int, default=64 << 20)
    p.add_argument("--num-pages", type=int, default=600)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if args.small:
        args.adds, args.restarts, args.repeats, args.ttft_adapters = 10, 1, 2, 2
    report = run(args)
    if args.json:
        print(json.dumps(report))
    else:
        for r in report["results"]:
            print(f"N={r['n']:>6}  add p50 {r['add_ms']['p50']:.1f} ms p99 {r['add_ms']['p99']:.1f} ms  "
                  f"list {r['list_ms']['median']:.1f} ms  ready {r['ready_s']['median']:.2f} s  "
                  f"cold TTFT {r['ttft_ms']['cold_median']:.1f} ms  warm {r['ttft_ms']['warm_median']:.1f} ms  "
                  f"RSS daemon {r['rss_mib']['at_ready']['daemon']:.0f} MiB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
