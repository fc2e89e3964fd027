"""Adapter load time against the link: how close the engine's layer-group copy of
one adapter (host store -> unified pool, `AdapterLoader`) comes to the bytes moved
divided by the measured pinned host-to-device bandwidth.

`--shape 7b` (or `8b`) lays out the pool of that model's dimensions (no weights
are needed to copy adapters); each rank's adapter lives in pinned host memory,
as the engine's host store does on CUDA. `ratio` = load time / (bytes / H2D
bandwidth): 1.0 is the link's speed. On CPU the "link" is a host memcpy and the
figures only check the script. Prints a table, or one JSON object with `--json`;
progress goes to stderr.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from model_shapes import add_model_args, resolve_model_args, shape_config

from loraplex.contracts.geometry import PageGeometry, plan_adapter_layout
from loraplex.gpu_engine.adapter_loader import AdapterLoader
from loraplex.gpu_engine.lora.peft_adapter import AdapterSpec, HostAdapter
from loraplex.gpu_engine.lora.torch_backend import resident_lora
from loraplex.gpu_engine.model.config import ModelConfig
from loraplex.gpu_engine.pool import UnifiedPool

TARGET_SETS = {"qv": ("q_proj", "v_proj"), "qkvo": ("q_proj", "k_proj", "v_proj", "o_proj"),
               "all": ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(p)
    p.add_argument("--ranks", type=int, nargs="+", default=[8, 16, 32, 64, 128])
    p.add_argument("--targets", choices=sorted(TARGET_SETS), default="qkvo")
    p.add_argument("--groups", type=int, default=4, help="layer groups per load (model.load_groups)")
    p.add_argument("--repeats", type=int, default=5, help="timed loads per rank (median reported)")
    p.add_argument("--h2d-mib", type=int, default=256, help="size of the pinned bandwidth probe")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    resolve_model_args(args)
    return args


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def h2d_gb_s(device: torch.device, dtype: torch.dtype, mib: int, repeats: int) -> float:
    """Pinned host -> device copy bandwidth (bytes moved once), median of `repeats`."""
    cuda = device.type == "cuda"
    n = (mib << 20) // torch.empty((), dtype=dtype).element_size()
    src = torch.randn(n).to(dtype)
    if cuda:
        src = src.pin_memory()
    dst = torch.empty(n, dtype=dtype, device=device)
    dst.copy_(src, non_blocking=cuda)
    samples = []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=cuda)
        sync(device)
        samples.append(time.perf_counter() - t0)
    return n * src.element_size() / statistics.median(samples) / 1e9


def host_adapter(cfg: ModelConfig, name: str, rank: int, targets: tuple[str, ...], dtype: torch.dtype,
                 pin: bool) -> HostAdapter:
    shapes = cfg.module_shapes()

    def host(*shape: int) -> torch.Tensor:
        t = (torch.randn(*shape) * 0.02).to(dtype)
        return t.pin_memory() if pin else t

    a = [{m: host(rank, shapes[m][0]) for m in targets} for _ in range(cfg.num_layers)]
    b = [{m: host(shapes[m][1], rank) for m in targets} for _ in range(cfg.num_layers)]
    return HostAdapter(name=name, path=Path("/random"), spec=AdapterSpec(rank, 2.0 * rank, False, targets), a=a, b=b)


def run(args: argparse.Namespace) -> dict[str, Any]:
    device, dtype = resolve_model_args(args)
    cfg = ModelConfig.from_hf(shape_config(args.shape))
    targets = TARGET_SETS[args.targets]
    shapes = cfg.module_shapes()
    geometry = PageGeometry.for_model(shapes, cfg.kv_dim, None)
    layouts = {r: plan_adapter_layout(geometry, shapes, targets, r) for r in args.ranks}
    pool = UnifiedPool(cfg.num_layers, max(lay.num_pages for lay in layouts.values()), geometry, device=device,
                       dtype=dtype)
    loader = AdapterLoader(pool)
    bandwidth = h2d_gb_s(device, dtype, args.h2d_mib, args.repeats)
    log(f"{args.shape} on {device}: {'pinned H2D' if device.type == 'cuda' else 'host copy'} {bandwidth:.2f} GB/s")
    rows = []
    for rank in args.ranks:
        adapter = host_adapter(cfg, f"r{rank}", rank, targets, dtype, pin=device.type == "cuda")
        layout = layouts[rank]
        resident = resident_lora(pool, adapter, layout, list(range(layout.num_pages)))
        samples = []
        for i in range(args.repeats + 1):  # the first load warms the copy path up, untimed
            sync(device)
            t0 = time.perf_counter()
            load = loader.start(adapter, resident, args.groups)
            for part in load.groups:
                load.wait_layer(part.start)
            sync(device)
            if i:
                samples.append(time.perf_counter() - t0)
        seconds = statistics.median(samples)
        ideal = adapter.nbytes / (bandwidth * 1e9)
        rows.append({"rank": rank, "bytes": adapter.nbytes, "pages": layout.num_pages, "load_s": seconds,
                     "ideal_s": ideal, "ratio": seconds / ideal, "gb_s": adapter.nbytes / seconds / 1e9})
        log(f"rank {rank}: {adapter.nbytes / 1e6:.1f} MB in {seconds * 1e3:.2f} ms ({seconds / ideal:.2f}x the link)")
    return {"benchmark": "adapter_load", "shape": args.shape, "device": str(device),
            "device_name": torch.cuda.get_device_name(device) if device.type == "cuda"
            else platform.processor() or platform.machine(), "dtype": args.dtype, "targets": args.targets,
            "groups": args.groups, "h2d_gb_s": bandwidth, "pinned": device.type == "cuda", "loads": rows}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with torch.no_grad():  # not inference_mode: CPU loads copy on a thread outside it
        report = run(args)
    if args.json:
        print(json.dumps(report))
        return 0
    print(f"{report['shape']} on {report['device_name']}: H2D {report['h2d_gb_s']:.2f} GB/s")
    for r in report["loads"]:
        print(f"rank {r['rank']:>4}: {r['bytes'] / 1e6:8.1f} MB  {r['load_s'] * 1e3:8.2f} ms  {r['ratio']:.2f}x ideal")
    return 0


if __name__ == "__main__":
    sys.exit(main())
