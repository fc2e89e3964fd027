"""Fault recovery: how long the daemon takes to recover from each fault, and
whether any request is lost, on the CPU demo model.

Starts `loraplex serve` on the random demo model (`ensure_demo_model()`, passed with
--model/--adapter) in a private runtime directory, with the engine's test-only fault hook
armed through a file (LORAPLEX_FAULTS=file=PATH), and injects each fault --repeats times
into a request in flight. A second daemon in `cpu_assist` mode with two CPU workers takes
the worker faults; a third, with a host store too small for every adapter
(--host-store-bytes), the cache manager's: SIGKILL or SIGSTOP with a request's load from
disk in flight (the process is stopped first so the load order is sure to be pending in
it). Warm spares (server.spare_children) are on unless --no-spare-children; each fault
waits for the spare to finish its imports first, so it measures a warm handoff. Per fault:
- `recovery_s`: from the fault to the affected request's first token after it (for a
  fault mid-decode, the gap in its stream; mid-prefill, fault to first token);
- `hello_s`: from the fault to the stats showing the replacement child running (engine:
  its new hello; worker: ready again); absent where nothing restarts;
- `requests`, `lost`: affected requests, and those that failed or whose tokens differ
  from an undisturbed greedy run of the same prompt on the same daemon.
`--json` prints one JSON object on stdout; progress goes to stderr.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

from soak import start_daemon, stop_daemon

from loraplex.ipc.client import Client, LoraplexError

LONG_PROMPT = [3 + (7 * i) % 500 for i in range(300)]
DECODE_PROMPT = [4, 5, 6]
COLD_ADAPTERS = ("all-r32", "mlp-r64", "attn-r16", "rslora-r16", "kdown-r8", "qv-r8")
CACHE_STORE_BYTES = 3_500_000  # the demo adapters take ~6.4 MB: some are always on disk


def _log(msg: str) -> None:
    print(f"[faults] {msg}", file=sys.stderr, flush=True)


class Stream(threading.Thread):
    """One greedy streaming request on its own connection; chunk arrival times recorded."""

    def __init__(self, runtime_dir: Path, prompt: list[int], adapter: str | None, max_tokens: int) -> None:
        super().__init__(daemon=True)
        self.runtime_dir, self.prompt, self.adapter, self.max_tokens = runtime_dir, prompt, adapter, max_tokens
        self.times: list[float] = []
        self.tokens: list[int] = []
        self.error: str | None = None
        self.start()

    def run(self) -> None:
        try:
            with Client(runtime_dir=self.runtime_dir) as c:
                for chunk in c.stream(self.prompt, adapter=self.adapter, max_tokens=self.max_tokens,
                                      temperature=0.0, ignore_eos=True, timeout=180):
                    if chunk.token_ids:
                        self.times.append(time.monotonic())
                        self.tokens.extend(chunk.token_ids)
        except LoraplexError as exc:
            self.error = exc.code.value

    def first_after(self, t: float) -> float | None:
        return next((x for x in self.times if x > t), None)


def stats(runtime_dir: Path) -> dict:
    with Client(runtime_dir=runtime_dir) as c:
        return c.stats()


def wait_for(predicate, timeout_s: float, interval_s: float = 0.02):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval_s)
    raise TimeoutError("condition not reached")


def reference(runtime_dir: Path, prompt: list[int], adapter: str | None, max_tokens: int) -> list[int]:
    with Client(runtime_dir=runtime_dir) as c:
        return c.generate(prompt, adapter=adapter, max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                          timeout=180).token_ids


def spare_warm(runtime_dir: Path) -> bool:
    return bool(stats(runtime_dir)["engine"].get("spare_ready"))


def cache_spare_warm(daemon_pid: int) -> bool:
    """The cache manager's spare waits on its stdin (the stats do not report it)."""
    for task in Path(f"/proc/{daemon_pid}/task").iterdir():
        for kid in (task / "children").read_text().split():
            try:
                cmdline = Path(f"/proc/{kid}/cmdline").read_bytes()
                spare = Path(f"/proc/{kid}/comm").read_text().strip() == "loraplex-spare"  # a former one: renamed
                if spare and b"cache_manager_process" in cmdline:
                    wchan = Path(f"/proc/{kid}/wchan").read_text()  # its stdin: a socketpair under asyncio
                    return "pipe_read" in wchan or "unix_stream_read" in wchan
            except OSError:
                continue
    return False


def engine_replaced(runtime_dir: Path, old_pid: int) -> bool:
    engine = stats(runtime_dir)["engine"]
    return engine["pid"] not in (None, old_pid) and engine["ready"]


def reap(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)  # a child of our daemon that it failed to end (never expected)
    except ProcessLookupError:
        pass


# -- one fault ------------------------------------------------------------------------------------

def engine_fault(rt: Path, kind: str, adapter: str | None, expected: list[int]) -> dict:
    """kind: sigkill_decode, sigstop_decode, sigkill_prefill, sigstop_prefill, raise."""
    if SPARES and kind.startswith("sig"):
        wait_for(lambda: spare_warm(rt), 60, 0.1)
    pid = stats(rt)["engine"]["pid"]
    prefill = kind.endswith("prefill")
    prompt = LONG_PROMPT if prefill else DECODE_PROMPT
    req = Stream(rt, prompt, adapter, len(expected))
    if prefill:
        wait_for(lambda: stats(rt)["running"] >= 1, 60)
    else:
        wait_for(lambda: len(req.times) >= 5, 60, 0.005)
    hit = time.monotonic()
    if kind.startswith("sig"):
        os.kill(pid, signal.SIGKILL if kind.startswith("sigkill") else signal.SIGSTOP)
    else:
        arm(rt, "step_raise=1")
    hello = None
    if kind.startswith("sig"):
        wait_for(lambda: engine_replaced(rt, pid), 60)
        hello = time.monotonic() - hit
    req.join(180)
    reap(pid) if kind.startswith("sigstop") else None
    after = [hit] + [t for t in req.times if t > hit]
    # Mid-decode: the longest gap from the fault on (a chunk already on its way may land just after it).
    recovery = None if len(after) < 2 else (after[1] - hit if prefill else max(b - a for a, b in zip(after, after[1:])))
    return {"recovery_s": recovery, "hello_s": hello, "lost": int(req.error is not None or req.tokens != expected)}


def oom_batch_fault(rt: Path, expected: dict[tuple[int, ...], list[int]]) -> dict:
    """Four requests decoding together; one step runs out of memory (the batch is halved)."""
    pid = stats(rt)["engine"]["pid"]
    reqs = [Stream(rt, list(p), None, len(e)) for p, e in expected.items()]
    wait_for(lambda: all(len(r.times) >= 3 for r in reqs), 60, 0.005)
    hit = time.monotonic()
    arm(rt, "step_oom=1")
    for r in reqs:
        r.join(180)
    firsts = [r.first_after(hit) for r in reqs]
    lost = sum(int(r.error is not None or r.tokens != e) for r, e in zip(reqs, expected.values()))
    assert stats(rt)["engine"]["pid"] == pid, "the engine restarted on an out-of-memory step"
    return {"recovery_s": None if None in firsts else max(firsts) - hit, "hello_s": None, "lost": lost,
            "requests": len(reqs)}


def idle_engine_stop(rt: Path) -> dict:
    if SPARES:
        wait_for(lambda: spare_warm(rt), 60, 0.1)
    pid = stats(rt)["engine"]["pid"]
    hit = time.monotonic()
    os.kill(pid, signal.SIGSTOP)
    wait_for(lambda: engine_replaced(rt, pid), 60)
    hello = time.monotonic() - hit
    reap(pid)
    return {"recovery_s": hello, "hello_s": hello, "lost": 0, "requests": 0}


def worker_fault(rt: Path, sig: int, adapter: str, expected: list[int], index: int = 0) -> dict:
    old = stats(rt)["cpu_assist"]["workers"][index]["pid"]
    req = Stream(rt, LONG_PROMPT, adapter, len(expected))
    wait_for(lambda: stats(rt)["running"] >= 1, 60)
    hit = time.monotonic()
    os.kill(old, sig)

    def replaced() -> bool:
        w = stats(rt)["cpu_assist"]["workers"][index]
        return w["pid"] != old and w["ready"]

    wait_for(replaced, 60)
    hello = time.monotonic() - hit
    req.join(180)
    reap(old) if sig == signal.SIGSTOP else None
    first = req.first_after(hit)
    return {"recovery_s": None if first is None else first - hit, "hello_s": hello,
            "lost": int(req.error is not None or req.tokens != expected)}


def cache_fault(rt: Path, daemon_pid: int, sig: int, refs: dict[str, list[int]]) -> dict:
    """The cache manager is SIGKILLed or SIGSTOPped while a request's adapter loads from disk."""
    if SPARES:
        wait_for(lambda: cache_spare_warm(daemon_pid), 60, 0.1)
    tier = stats(rt)["host_tier"]
    adapter = next(a for a in refs if a not in tier["resident"])  # on disk: the request needs a load
    old, old_segment = tier["pid"], tier["segment"]
    os.kill(old, signal.SIGSTOP)  # first, so the load order is sure to land on (and stay in) the process
    hit = time.monotonic()
    req = Stream(rt, DECODE_PROMPT, adapter, len(refs[adapter]))
    if sig == signal.SIGKILL:
        time.sleep(0.3)  # the order is in flight
        os.kill(old, signal.SIGKILL)
        hit = time.monotonic()

    def replaced() -> bool:
        host = stats(rt)["host_tier"]  # a new segment: the replacement said hello
        return host["pid"] != old and host["alive"] and host["segment"] not in ("", old_segment)

    wait_for(replaced, 60)
    hello = time.monotonic() - hit
    req.join(180)
    reap(old)
    first = req.first_after(hit)
    return {"recovery_s": None if first is None else first - hit, "hello_s": hello,
            "lost": int(req.error is not None or req.tokens != refs[adapter])}


@contextlib.contextmanager
def _workdir():
    """A scratch directory, kept (with the daemons' logs) when the run fails."""
    path = tempfile.mkdtemp(prefix="loraplex-faults-")
    try:
        yield path
    except BaseException:
        _log(f"failed: daemon logs kept in {path}/*/daemon.log")
        raise
    shutil.rmtree(path, ignore_errors=True)


FAULT_FILE: dict[Path, Path] = {}
SPARES = True


def arm(rt: Path, spec: str) -> None:
    path = FAULT_FILE[rt]
    tmp = path.with_suffix(".tmp")
    tmp.write_text(spec)
    os.rename(tmp, path)


# -- driver ---------------------------------------------------------------------------------------

def summarise(runs: list[dict]) -> dict:
    out: dict = {"runs": len(runs), "requests": sum(r.get("requests", 1) for r in runs),
                 "lost": sum(r["lost"] for r in runs)}
    for key in ("recovery_s", "hello_s"):
        values = [r[key] for r in runs if r[key] is not None]
        if values:
            out[key] = {"median": round(statistics.median(values), 3), "max": round(max(values), 3),
                        "all": [round(v, 3) for v in values]}
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3, help="injections per fault type")
    parser.add_argument("--throttle-bytes-s", type=float, default=3e6,
                        help="adapter load throttle, so a cold-adapter prefill lasts long enough to hit")
    parser.add_argument("--heartbeat-timeout-s", type=float, default=None, help="server.heartbeat_timeout_s")
    parser.add_argument("--no-spare-children", action="store_true",
                        help="server.spare_children = false: every restart spawns a cold process")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    global SPARES
    SPARES = not args.no_spare_children
    from loraplex.gpu_engine.demo import ensure_demo_model

    demo = ensure_demo_model()
    serve = ["--model", str(demo.model_dir), "--num-pages", "600", "--max-num-seqs", "16"]
    for name, path in demo.adapters.items():
        serve += ["--adapter", f"{name}={path}"]
    env_extra = {"LORAPLEX_MODEL_LOAD_THROTTLE_BYTES_S": str(args.throttle_bytes_s)}
    if args.heartbeat_timeout_s is not None:
        env_extra["LORAPLEX_SERVER_HEARTBEAT_TIMEOUT_S"] = str(args.heartbeat_timeout_s)
    env_extra["LORAPLEX_SERVER_SPARE_CHILDREN"] = "true" if SPARES else "false"
    results: dict[str, list[dict]] = {}
    with _workdir() as tmp:
        root = Path(tmp)
        (root / "a").mkdir()
        (root / "b").mkdir()
        (root / "c").mkdir()
        os.environ.update(env_extra)
        os.environ["LORAPLEX_FAULTS"] = f"file={root / 'fault'}"  # test/bench-only hook of the engine
        proc, rt = start_daemon(root / "a", serve)
        FAULT_FILE[rt] = root / "fault"
        try:
            decode = reference(rt, DECODE_PROMPT, None, 30)
            # Undisturbed tokens of the long prompt per adapter (cpu_assist gives the same tokens). The
            # engine restarts before the prefill faults below, so their adapters are cold again.
            long_ref = {a: reference(rt, LONG_PROMPT, a, 4) for a in COLD_ADAPTERS}
            batch = {tuple(p): reference(rt, p, None, 16) for p in ([5 + i, 6, 7 + i] for i in range(4))}
            for kind in ("sigkill_decode", "sigstop_decode", "raise"):
                for i in range(args.repeats):
                    _log(f"engine {kind} #{i + 1}")
                    results.setdefault(f"engine_{kind}", []).append(engine_fault(rt, kind, None, decode))
            for kind in ("sigkill_prefill", "sigstop_prefill"):
                for i in range(args.repeats):
                    adapter = COLD_ADAPTERS[i % len(COLD_ADAPTERS)]  # cold: every fault restarts the engine
                    _log(f"engine {kind} #{i + 1} ({adapter})")
                    results.setdefault(f"engine_{kind}", []).append(
                        engine_fault(rt, kind, adapter, long_ref[adapter]))
            for i in range(args.repeats):
                _log(f"engine idle sigstop #{i + 1}")
                results.setdefault("engine_sigstop_idle", []).append(idle_engine_stop(rt))
            for i in range(args.repeats):
                _log(f"oom in a batch of 4 #{i + 1}")
                results.setdefault("engine_oom_batch", []).append(oom_batch_fault(rt, batch))
        finally:
            status_a = stop_daemon(proc)
        proc, rt = start_daemon(root / "b", [*serve, "--adapter-load-mode", "cpu_assist", "--cpu-workers", "2"])
        try:
            for sig, label in ((signal.SIGKILL, "sigkill"), (signal.SIGSTOP, "sigstop")):
                for i in range(args.repeats):
                    # each adapter's first use here: cold, so its prefill is CPU-assisted
                    adapter = COLD_ADAPTERS[(2 * i + (sig == signal.SIGSTOP)) % len(COLD_ADAPTERS)]
                    _log(f"cpu worker {label} mid-prefill #{i + 1} ({adapter})")
                    results.setdefault(f"cpu_worker_{label}_prefill", []).append(
                        worker_fault(rt, sig, adapter, long_ref[adapter]))
        finally:
            status_b = stop_daemon(proc)
        # The host tier: no load throttle (the cache manager reads from disk at disk speed anyway).
        os.environ.pop("LORAPLEX_MODEL_LOAD_THROTTLE_BYTES_S")
        proc, rt = start_daemon(root / "c", [*serve, "--host-store-bytes", str(CACHE_STORE_BYTES)])
        try:
            refs = {a: reference(rt, DECODE_PROMPT, a, 8) for a in COLD_ADAPTERS}
            for sig, label in ((signal.SIGKILL, "sigkill"), (signal.SIGSTOP, "sigstop")):
                for i in range(args.repeats):
                    _log(f"cache manager {label} mid-load #{i + 1}")
                    results.setdefault(f"cache_manager_{label}_load", []).append(cache_fault(rt, proc.pid, sig, refs))
        finally:
            status_c = stop_daemon(proc)
    report = {
        "bench": "faults", "host": platform.node(), "cpus": os.cpu_count(), "load_avg_1m": os.getloadavg()[0],
        "repeats": args.repeats, "throttle_bytes_s": args.throttle_bytes_s,
        "heartbeat_timeout_s": args.heartbeat_timeout_s or 3.0, "daemon_exit": [status_a, status_b, status_c],
        "spare_children": SPARES,
        "faults": {name: summarise(runs) for name, runs in results.items()},
    }
    report["lost_total"] = sum(f["lost"] for f in report["faults"].values())
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        for name, f in report["faults"].items():
            rec = f.get("recovery_s", {})
            print(f"{name:28s} lost {f['lost']}/{f['requests']}  recovery median {rec.get('median')} s "
                  f"max {rec.get('max')} s  hello {f.get('hello_s', {}).get('median')} s")
    return 0 if report["lost_total"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
