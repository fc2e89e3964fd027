"""Cold-adapter load modes side by side on a live daemon (Toppings' comparison):
mean and P99 TTFT of `cached` (every adapter preloaded on the GPU), `on_demand`
(copied when a request needs it) and `cpu_assist` (CPU workers compute the LoRA
delta while layer groups stream in), one fresh daemon per mode, the same seeded
Poisson/Zipf workload against each.

`--shape 7b` / `8b` serve a random-weight model of Llama-2-7B / Llama-3-8B (GQA)
dimensions built on the device (`model.load_format = "dummy"`: a config.json
alone, nothing downloaded); `--shape tiny` runs anywhere in seconds. Adapters:
`--adapters` (200) names with ranks drawn from 8-128 by the shared workload
generator; one PEFT file is written per distinct rank and the others are hard
links to it, so 200 adapters of a 7B model cost one write per rank. The host
store is sized to hold them all (`--host-store-gb` caps it). `--json` prints one
JSON object on stdout; progress goes to stderr.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from cache_live import merge, one_load, warm_up
from model_shapes import SHAPES, shape_config, write_model_dir
from soak import start_daemon, stop_daemon

from loraplex.daemon.sim.workload import WorkloadSpec, adapter_ranks

MODES = ("cached", "on_demand", "cpu_assist")
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--dtype", default="auto", help="auto: bfloat16 on cuda, float32 on cpu")
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated subset of " + ",".join(MODES))
    p.add_argument("--adapters", type=int, default=200)
    p.add_argument("--rate", type=float, default=4.0, help="Poisson arrivals per second")
    p.add_argument("--duration", type=float, default=30.0, help="seconds of arrivals per mode")
    p.add_argument("--zipf", type=float, default=1.0)
    p.add_argument("--prompt-mean", type=int, default=256)
    p.add_argument("--output-mean", type=int, default=32)
    p.add_argument("--max-prompt", type=int, default=1024)
    p.add_argument("--max-output", type=int, default=128)
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--cpu-workers", type=int, default=None, help="cpu_assist workers (default: the daemon's)")
    p.add_argument("--host-store-gb", type=float, default=48.0, help="cap of the host adapter store")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    args.modes = [m for m in args.modes.split(",") if m]
    unknown = sorted(set(args.modes) - set(MODES))
    if unknown:
        p.error(f"unknown modes {unknown}; choose from {MODES}")
    return args


def write_adapters(root: Path, spec: WorkloadSpec, config: dict) -> dict[str, tuple[Path, int, int]]:
    """name -> (dir, rank, bytes): one PEFT adapter written per distinct rank, hard links for the rest."""
    from loraplex.gpu_engine.demo.adapter import write_random_adapter

    by_rank: dict[int, Path] = {}
    out = {}
    for name, rank in adapter_ranks(spec).items():
        dest = root / name
        if rank not in by_rank:
            write_random_adapter(dest, config, rank=rank, alpha=float(rank), target_modules=list(TARGETS),
                                 seed=1000 + rank)
            by_rank[rank] = dest
        else:
            dest.mkdir(parents=True)
            for f in by_rank[rank].iterdir():
                os.link(f, dest / f.name)
        out[name] = (dest, rank, (dest / "adapter_model.safetensors").stat().st_size)
    return out


def wait_host_warm(runtime_dir: Path, timeout_s: float = 300.0, still_s: float = 3.0) -> int:
    """Start-up reads no adapter file and the host store warms in the background: wait until every
    adapter is in host memory (or on the GPU), or the count on disk has stopped falling for
    `still_s` (the store is full), so a cold request costs host -> GPU, as in Toppings. Returns
    the adapters left on disk."""
    from loraplex.ipc.client import Client

    deadline = time.monotonic() + timeout_s
    last, since = None, time.monotonic()
    with Client(runtime_dir=runtime_dir) as client:
        while True:
            disk = int(client.stats()["adapter_counts"]["tiers"]["disk"])
            if disk != last:
                last, since = disk, time.monotonic()
            if disk == 0 or time.monotonic() - since > still_s or time.monotonic() > deadline:
                return disk
            time.sleep(0.1)


def run(args: argparse.Namespace) -> dict[str, Any]:
    config = shape_config(args.shape)
    spec = WorkloadSpec(seed=args.seed, duration_s=args.duration, rate_rps=args.rate, num_adapters=args.adapters,
                        zipf_exponent=args.zipf, prompt_mean=args.prompt_mean, output_mean=args.output_mean,
                        max_prompt=args.max_prompt, max_output=args.max_output)
    rows: dict[str, dict] = {}
    exits: dict[str, int] = {}
    loadavg_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="lpx-load-modes-") as tmp:
        root = Path(tmp)
        model_dir = write_model_dir(root / "model", args.shape)
        started = time.monotonic()
        adapters = write_adapters(root / "adapters", spec, config)
        total_bytes = sum(b for _, _, b in adapters.values())
        log(f"{len(adapters)} adapters ({total_bytes / 1e9:.2f} GB) written in {time.monotonic() - started:.1f} s")
        store = min(int(total_bytes * 1.25) + (64 << 20), int(args.host_store_gb * 2 ** 30))
        serve = ["--model", str(model_dir), "--load-format", "dummy", "--device", args.device,
                 "--dtype", args.dtype, "--max-num-seqs", str(args.max_num_seqs), "--host-store-bytes", str(store)]
        if args.cpu_workers:
            serve += ["--cpu-workers", str(args.cpu_workers)]
        register = [arg for name, (path, _, _) in adapters.items() for arg in ("--adapter", f"{name}={path}")]
        # One registry for every mode's daemon: the first registers the adapters, and the content
        # hash it records (with sizes and mtimes) spares the others re-reading every file, so a
        # cold request's TTFT is the load, not a first-use hash.
        state = root / "state"
        state.mkdir()
        for i, mode in enumerate(args.modes):
            home = root / mode
            home.mkdir()
            (home / "state").symlink_to(state)
            log(f"{mode}: starting the daemon")
            t0 = time.monotonic()
            proc, runtime_dir = start_daemon(home, [*serve, *(register if i == 0 else []),
                                                    "--adapter-load-mode", mode])
            ready_s = time.monotonic() - t0
            try:
                on_disk = wait_host_warm(runtime_dir)
                warm_s = time.monotonic() - t0 - ready_s
                warm_up(runtime_dir)
                raw = one_load(runtime_dir, spec, int(config["vocab_size"]))
                rows[mode] = {**merge(args.rate, [raw]), "ready_s": round(ready_s, 2),
                              "host_warm_s": round(warm_s, 2), "left_on_disk": on_disk}
                ttft = rows[mode]["ttft_ms"]
                log(f"{mode}: {rows[mode]['completed']}/{rows[mode]['requests']} done, TTFT mean {ttft['mean']} "
                    f"p99 {ttft['p99']} ms (ready in {ready_s:.1f} s)")
            finally:
                exits[mode] = stop_daemon(proc)
    ratios = {}
    for mine, other in (("cpu_assist", "on_demand"), ("cached", "on_demand"), ("cpu_assist", "cached")):
        if mine in rows and other in rows:
            for stat in ("mean", "p99"):
                theirs = rows[other]["ttft_ms"][stat]
                ratios[f"{mine}_over_{other}_{stat}"] = round(rows[mine]["ttft_ms"][stat] / theirs, 3) if theirs \
                    else None
    return {"benchmark": "load_modes", "shape": args.shape,
            "config": {"adapters": args.adapters, "adapter_bytes": total_bytes, "rate_rps": args.rate,
                       "duration_s": args.duration, "zipf": args.zipf, "prompt_mean": args.prompt_mean,
                       "output_mean": args.output_mean, "targets": list(TARGETS), "host_store_bytes": store,
                       "serve_args": serve, "seed": args.seed},
            "modes": rows, "ratios": ratios, "daemon_exit": exits,
            "environment": {"device": args.device, "cpu_count": os.cpu_count(), "python": platform.python_version(),
                            "loadavg_1m_before": loadavg_before, "loadavg_1m_after": os.getloadavg()[0]}}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report = run(args)
    failed = [m for m, code in report["daemon_exit"].items() if code != 0]
    if args.json:
        print(json.dumps(report))
    else:
        for mode, row in report["modes"].items():
            t = row["ttft_ms"]
            print(f"{mode:>10}: TTFT mean {t['mean']:8.1f} ms  p99 {t['p99']:8.1f} ms  "
                  f"{row['completed']}/{row['requests']} done")
        for key, value in report["ratios"].items():
            print(f"{key}: {value}")
    if failed:
        log(f"daemons exited non-zero: {failed}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
