"""No request can hurt another (issue 31's figures): one victim stream's gaps between tokens
while another client sends, one case at a time, what used to stall or fail everyone.

Starts `loraplex serve` on the demo model (random weights unless `--demo trained`) in a private
runtime directory and `loraplex gateway` on a free loopback port, warms both up, then runs one
phase per case after a baseline with no abuse. In every phase:

- the victim: one greedy `ignore_eos` completion of `--victim-tokens` streamed through the
  gateway (`/v1/completions`, SSE, `logprobs: 0` so each token is an event), timestamped here;
- others: `--others` threads sending ordinary short requests in a loop, alternately through
  the gateway and straight to the daemon (the client library), all counted and checked;
- the abuser (not in the baseline), after `--settle-s`: the case's requests, one after another:
  `deep_schema`: a `--schema-levels` (480) nested object schema as `guided_json` text, as
  `response_format` json_schema (an object: the body nests as deep), and as raw msgpack on the
  daemon's client socket (past the client library's own check);
  `tiny_temperature`: completions and chat with `temperature` `--temperature` (1e-45), each
  `--abuse-tokens` (32) tokens long;
  `big_body`: a `--body-mb` (57) MB completions body of token ids, its Content-Length honest;
  `deep_brackets`: `--brackets` (5,000) `[`, bare and as the prompt.

The window runs from the abuse's start for at least `--window-s`; a second baseline ends the
run, to show how far the host drifted meanwhile. Reported per phase: the victim's largest, p99
and median gap (s; the window's ends count, so a stall to the end shows), its ratio to the
baseline's, every abuse request's status, error code and seconds to its reply, the others'
requests and failures (a victim that fails or ends early counts as one), the daemon's engine
restarts and the host's load; then each case against the targets (largest gap < 0.5 s, 0
failures of other clients, the abuse answered as expected). `--json` prints one JSON object on stdout,
`--out FILE` writes it; progress goes to stderr. `--engine-threads` (1) sets the daemon's
OMP_NUM_THREADS, as bench/cache_live.py does: on a shared 2-core host two spinning torch threads
turn another process's load into stalls of the engine's own steps.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import shlex
import statistics
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from abuse_http import GatewayProcess, SseStream, post
from flood_gap import warm_up
from soak import start_daemon, stop_daemon

from loraplex.ipc.client import Client, LoraplexError

CASES = ("deep_schema", "tiny_temperature", "big_body", "deep_brackets")
MAX_GAP_S = 0.5  # the bound on the victim's largest gap
VICTIM_PROMPT = [11, 12, 13]
SERVE_ARGS = ["--num-pages", "600", "--max-num-seqs", "16"]


_STARTED = time.monotonic()


def _log(msg: str) -> None:
    print(f"[abuse_gap {time.monotonic() - _STARTED:6.1f} s] {msg}", file=sys.stderr, flush=True)


# -- the abuse --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Abuse:
    """One hostile request and the answer it should get: (status, error code or None)."""

    name: str
    path: str  # an HTTP path, or "daemon" for raw msgpack on the daemon's client socket
    body: bytes
    expect: tuple[int, str | None]


def nested_schema(levels: int) -> str:
    """An object schema `levels` deep, as text (json.dumps of a dict this deep overflows the stack)."""
    schema = '{"type":"string"}'
    for _ in range(levels):
        schema = f'{{"type":"object","properties":{{"a":{schema}}},"required":["a"]}}'
    return schema


def token_ids_body(size: int) -> bytes:
    """A completions body of about `size` bytes: one prompt of token ids (made without json.dumps)."""
    return b'{"prompt": [' + b"11, " * (size // 4) + b'11], "max_tokens": 4}'


def abuses(case: str, args: argparse.Namespace) -> list[Abuse]:
    if case == "deep_schema":
        schema = nested_schema(args.schema_levels)
        text = json.dumps({"prompt": [31, 32, 33], "max_tokens": 8, "guided_json": schema}).encode()
        chat = (b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "response_format": '
                b'{"type": "json_schema", "json_schema": {"name": "deep", "schema": ' + schema.encode() + b"}}}")
        return [Abuse("guided_json text", "/v1/completions", text, (400, "grammar_too_complex")),
                Abuse("response_format object", "/v1/chat/completions", chat, (400, "invalid_json")),
                Abuse("raw msgpack to the daemon", "daemon", schema.encode(), (400, "grammar_too_complex"))]
    if case == "tiny_temperature":
        t, n = args.temperature, args.abuse_tokens
        completion = json.dumps({"prompt": [41, 42, 43], "max_tokens": n, "temperature": t, "ignore_eos": True})
        chat = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": n, "temperature": t})
        return [Abuse("completions", "/v1/completions", completion.encode(), (200, None)),
                Abuse("chat", "/v1/chat/completions", chat.encode(), (200, None))]
    if case == "big_body":
        body = token_ids_body(int(args.body_mb * 1e6))
        return [Abuse(f"{len(body) / 1e6:.1f} MB of token ids", "/v1/completions", body, (413, "request_too_large"))]
    if case == "deep_brackets":
        n = args.brackets
        return [Abuse("bare", "/v1/completions", b"[" * n, (400, "invalid_json")),
                Abuse("as the prompt", "/v1/completions", b'{"prompt": ' + b"[" * n + b"]" * n + b"}",
                      (400, "invalid_json"))]
    raise ValueError(f"unknown case {case!r}; the cases are {', '.join(CASES)}")


def raw_generate(runtime_dir: Path, spec: str, timeout: float = 60.0) -> dict[str, Any]:
    """A guided generate as raw msgpack on the client socket, past the client library's checks:
    the daemon must refuse it itself. A refusal stands in for HTTP 400 here."""
    import msgpack
    import zmq

    from loraplex.ipc.codec import decode
    from loraplex.ipc.protocol import PROTOCOL_VERSION

    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"ipc://{runtime_dir}/client.sock")
    started = time.monotonic()
    try:
        sock.send(msgpack.packb({"v": PROTOCOL_VERSION, "type": "generate", "request_id": uuid.uuid4().hex,
                                 "prompt": "x", "max_tokens": 4, "guided_kind": "json_schema", "guided_spec": spec}))
        while True:
            if not sock.poll(int(timeout * 1000)):
                return {"status": None, "code": None, "error": "no reply", "seconds": timeout}
            reply = decode(sock.recv_multipart()[-1])
            if reply.TYPE != "pong":  # the daemon's liveness probe
                break
    finally:
        sock.close()
    fields = reply.to_fields()
    code = fields.get("code")
    return {"status": 400 if code else 200, "code": code, "error": None,
            "seconds": round(time.monotonic() - started, 3), "message": (fields.get("message") or "")[:200]}


def send_abuse(abuse: Abuse, port: int, runtime_dir: Path) -> dict[str, Any]:
    if abuse.path == "daemon":
        result = raw_generate(runtime_dir, abuse.body.decode())
    else:
        result = post(port, abuse.path, abuse.body)
    expected = (result["status"], result["code"]) == abuse.expect
    return {"name": abuse.name, "path": abuse.path, "bytes": len(abuse.body), "expect": list(abuse.expect),
            **result, "as_expected": expected}


# -- the other clients ------------------------------------------------------------------------------------

class Others:
    """`count` threads each sending ordinary short requests in a loop until stopped: even ones
    through the gateway, odd ones straight to the daemon."""

    def __init__(self, port: int, runtime_dir: Path, count: int) -> None:
        self.port, self.runtime_dir = port, runtime_dir
        self.stop_event = threading.Event()
        self.lock = threading.Lock()
        self.requests, self.failures, self.errors = 0, 0, []
        self.threads = [threading.Thread(target=self._loop, args=(i,), daemon=True) for i in range(count)]

    def start(self) -> None:
        for t in self.threads:
            t.start()

    def stop(self) -> dict[str, Any]:
        self.stop_event.set()
        for t in self.threads:
            t.join(90)
        return {"requests": self.requests, "failures": self.failures, "errors": self.errors[:5]}

    def _loop(self, index: int) -> None:
        client = Client(runtime_dir=self.runtime_dir) if index % 2 else None
        i = 0
        try:
            while not self.stop_event.is_set():
                seed = index * 1000 + i
                try:
                    error = self._via_daemon(client, seed) if client else self._via_gateway(seed)
                except Exception as exc:  # a failure of this client, whatever it is, is what is counted
                    error = repr(exc)
                with self.lock:
                    self.requests += 1
                    if error is not None:
                        self.failures += 1
                        self.errors.append(error)
                i += 1
        finally:
            if client is not None:
                client.close()

    def _via_gateway(self, seed: int) -> str | None:
        body = {"prompt": [51, 52, 53, 54 + seed % 50], "max_tokens": 8, "temperature": 0.8, "seed": seed}
        result = post(self.port, "/v1/completions", json.dumps(body).encode())
        if result["status"] != 200:
            return f"gateway: {result['status']} {result['code']} {result['error'] or result.get('message')}"
        return None

    @staticmethod
    def _via_daemon(client: Client, seed: int) -> str | None:
        try:
            result = client.generate([61, 62, 63, 64 + seed % 50], max_tokens=8, temperature=0.8, seed=seed,
                                     timeout=60)
        except LoraplexError as exc:
            return f"daemon: {exc.code.value} {exc}"
        return None if result.token_ids else "daemon: no tokens"


# -- one phase --------------------------------------------------------------------------------------------

def gap_summary(gaps: list[float]) -> dict[str, Any]:
    if not gaps:
        return {"tokens": 0, "max_gap_s": None, "p99_gap_s": None, "median_gap_s": None}
    ordered = sorted(gaps)
    p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
    return {"tokens": len(gaps) - 1, "max_gap_s": round(ordered[-1], 4), "p99_gap_s": round(p99, 4),
            "median_gap_s": round(statistics.median(ordered), 4)}


def engine_restarts(runtime_dir: Path) -> int | None:
    try:
        with Client(runtime_dir=runtime_dir) as client:
            return int(client.stats(timeout=10)["engine_restarts"])
    except LoraplexError:
        return None


def phase(port: int, runtime_dir: Path, args: argparse.Namespace, requests: list[Abuse]) -> dict[str, Any]:
    """The victim and the others run; after settle_s the abuse is sent; the window lasts at least
    window_s from then. gc is frozen meanwhile: a full collection of this process's heap would
    pause the thread that timestamps the victim's tokens."""
    started, load_before = time.monotonic(), os.getloadavg()[0]
    restarts_before = engine_restarts(runtime_dir)
    victim = SseStream(port, VICTIM_PROMPT, args.victim_tokens)
    victim.start()
    others = Others(port, runtime_dir, args.others)
    gc.collect()
    gc.freeze()
    try:
        if not victim.started.wait(60) or victim.status != 200:
            raise RuntimeError(f"the victim stream did not start: {victim.status} {victim.error}")
        first_token = time.monotonic()
        others.start()
        time.sleep(args.settle_s)
        since = time.monotonic()
        sent = [send_abuse(a, port, runtime_dir) for a in requests]
        time.sleep(max(0.0, since + args.window_s - time.monotonic()))
        until = time.monotonic()
        ended_early = victim.ended is not None  # it must outlive the window
        victim.close()
        closed = time.monotonic()
        other = others.stop()
    finally:
        gc.unfreeze()
    victim_failed = victim.status != 200 or victim.error is not None or ended_early
    restarts_after = engine_restarts(runtime_dir)
    return {
        "victim": {**gap_summary(victim.gaps_s(since, until)), "window_s": round(until - since, 3),
                   "status": victim.status, "error": victim.error, "ended_early": ended_early},
        "abuse": sent,
        "others": other,
        "failures_of_others": other["failures"] + int(victim_failed),
        "engine_restarts": None if None in (restarts_before, restarts_after) else restarts_after - restarts_before,
        "loadavg_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        "phase_s": {"to_first_token": round(first_token - started, 3), "victim_close": round(closed - until, 3),
                    "others_stop": round(time.monotonic() - closed, 3), "total": round(time.monotonic() - started, 3)},
    }


def _ratio(value: float | None, base: float | None) -> float | None:
    return None if value is None or not base else round(value / base, 2)


def judge(result: dict[str, Any], baseline: dict[str, Any]) -> None:
    victim, base = result["victim"], baseline["victim"]
    result["ratio_to_baseline"] = {"max_gap": _ratio(victim["max_gap_s"], base["max_gap_s"]),
                                   "p99_gap": _ratio(victim["p99_gap_s"], base["p99_gap_s"])}
    answered = [a["seconds"] for a in result["abuse"]]
    result["abuse_answered_within_s"] = max(answered) if answered else None
    result["targets"] = {
        "max_gap_under_0.5_s": victim["max_gap_s"] is not None and victim["max_gap_s"] < MAX_GAP_S,
        "no_failures_of_others": result["failures_of_others"] == 0,
        "abuse_answered_as_expected": all(a["as_expected"] for a in result["abuse"]),
    }
    result["meets_targets"] = all(result["targets"].values())


# -- the run ----------------------------------------------------------------------------------------------

def machine() -> dict[str, Any]:
    def version(name: str) -> str | None:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return None

    return {"device": "cpu", "cpu_count": os.cpu_count(), "torch": version("torch"), "xgrammar": version("xgrammar"),
            "python": platform.python_version(), "platform": platform.platform()}


def run(args: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
    started = time.monotonic()
    cases = [c for c in args.cases.split(",") if c]
    requests = {case: abuses(case, args) for case in cases}  # built before any window (57 MB takes a while)
    os.environ["LORAPLEX_DEMO"] = args.demo  # the daemon serves that built-in demo (no torch import here)
    if args.engine_threads:
        # On a shared 2-core host torch's OpenMP threads spin against other processes: a decode step
        # of the tiny model took 140 ms (p99 0.6 s) with 2 threads beside another busy process.
        os.environ["OMP_NUM_THREADS"] = str(args.engine_threads)
    serve_args = list(SERVE_ARGS)
    load_before = os.getloadavg()
    report: dict[str, Any] = {"benchmark": "abuse_gap", "command": shlex.join(["python", "bench/abuse_gap.py", *argv])}
    with tempfile.TemporaryDirectory(prefix="lpx-abuse-") as tmp:
        _log("starting the daemon")
        proc, runtime_dir = start_daemon(Path(tmp), serve_args)
        gateway = None
        try:
            warm_up(runtime_dir)
            with Client(runtime_dir=runtime_dir) as client:
                context = client.tokenize("").max_model_len
            _log("starting the gateway")
            gateway = GatewayProcess(runtime_dir)
            first = post(gateway.port, "/v1/completions", b'{"prompt": [5, 6, 7], "max_tokens": 4}')
            if first["status"] != 200:
                raise RuntimeError(f"the gateway's first request failed: {first}")
            _log("baseline: no abuse")
            baseline = phase(gateway.port, runtime_dir, args, [])
            report_cases: dict[str, Any] = {}
            for case in cases:
                _log(f"case {case}")
                report_cases[case] = phase(gateway.port, runtime_dir, args, requests[case])
                judge(report_cases[case], baseline)
            _log("baseline again: no abuse (how much the host drifted meanwhile)")
            baseline_end = phase(gateway.port, runtime_dir, args, [])
        finally:
            _log("stopping")
            gateway_exit = gateway.stop() if gateway is not None else None
            daemon_exit = stop_daemon(proc)
            _log("stopped")
            if daemon_exit != 0 or gateway_exit not in (0, None):
                _log(f"daemon exit {daemon_exit}, gateway exit {gateway_exit}; daemon log tail:\n"
                     + (Path(tmp) / "daemon.log").read_text(errors="replace")[-3000:])
    report.update({
        "config": {"cases": cases, "demo": args.demo, "serve_args": serve_args, "max_model_len": context,
                   "engine_threads": args.engine_threads or os.environ.get("OMP_NUM_THREADS"),
                   "victim": {"via": "gateway /v1/completions, SSE", "prompt": VICTIM_PROMPT,
                              "max_tokens": args.victim_tokens, "temperature": 0.0, "ignore_eos": True},
                   "others": args.others, "window_s": args.window_s, "settle_s": args.settle_s,
                   "schema_levels": args.schema_levels, "temperature": args.temperature,
                   "abuse_tokens": args.abuse_tokens, "body_mb": args.body_mb,
                   "brackets": args.brackets},
        "targets": {"max_gap_s": MAX_GAP_S, "failures_of_others": 0},
        "baseline": baseline,
        "cases": report_cases,
        "baseline_end": baseline_end,
        "all_targets_met": all(c["meets_targets"] for c in report_cases.values()),
        "exit_status": {"daemon": daemon_exit, "gateway": gateway_exit},
        "env": {**machine(), "loadavg_before": [round(x, 2) for x in load_before],
                "loadavg_after": [round(x, 2) for x in os.getloadavg()]},
        "seconds": round(time.monotonic() - started, 1),
    })
    return report


def table(report: dict[str, Any]) -> str:
    lines = [f"{'phase':18s} {'max gap s':>9s} {'p99 s':>7s} {'x base':>6s} {'others':>9s}  abuse (status code s)"]
    rows = [("baseline", report["baseline"]), *report["cases"].items(), ("baseline_end", report["baseline_end"])]
    for name, r in rows:
        v = r["victim"]
        ratio = r.get("ratio_to_baseline", {}).get("max_gap")
        abuse = "; ".join(f"{a['status']} {a['code']} {a['seconds']}" for a in r["abuse"]) or "-"
        lines.append(f"{name:18s} {v['max_gap_s']!s:>9s} {v['p99_gap_s']!s:>7s} {ratio!s:>6s} "
                     f"{r['failures_of_others']:>3d}/{r['others']['requests']:<5d}  {abuse}")
    lines.append(f"all targets met: {report['all_targets_met']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)} (all)")
    parser.add_argument("--demo", choices=("random", "trained"), default="random",
                        help="which demo model the daemon serves (default random: the gap tests' model)")
    parser.add_argument("--victim-tokens", type=int, default=4000, help="the victim stream's max_tokens (4000)")
    parser.add_argument("--others", type=int, default=2, help="threads of ordinary requests (2)")
    parser.add_argument("--window-s", type=float, default=5.0, help="least seconds measured per phase (5)")
    parser.add_argument("--settle-s", type=float, default=1.0,
                        help="seconds from the victim's first token to the abuse (1)")
    parser.add_argument("--schema-levels", type=int, default=480, help="nested object levels of deep_schema (480)")
    parser.add_argument("--temperature", type=float, default=1e-45, help="tiny_temperature's temperature (1e-45)")
    parser.add_argument("--abuse-tokens", type=int, default=32, help="tiny_temperature's max_tokens (32)")
    parser.add_argument("--body-mb", type=float, default=57.0, help="big_body's size in MB (57)")
    parser.add_argument("--brackets", type=int, default=5000, help="deep_brackets' nesting (5000)")
    parser.add_argument("--engine-threads", type=int, default=1,
                        help="OMP_NUM_THREADS of the daemon's processes (default 1; 0: inherit)")
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    parser.add_argument("--out", type=Path, help="write the JSON object to this file")
    args = parser.parse_args(argv)
    for case in args.cases.split(","):
        if case and case not in CASES:
            parser.error(f"unknown case {case!r}; the cases are {', '.join(CASES)}")
    report = run(args, argv)
    if args.out is not None:
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    sys.stdout.write(json.dumps(report) + "\n" if args.json else table(report) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
