"""How the torch LoRA backend reads an adapter's rows from the unified pool each step: gathered
element by element through the [r, width] index (before), or whole rows through index_select over
an unfold view (gpu_engine/lora/torch_backend.py pool_rows, now). Rows start at random offsets
of one pool layer, as pages scatter them; microseconds per gather (median of `--repeats`, the two
taking turns) and the ratio, one torch thread.

    .venv/bin/python bench/lora_rows.py --json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from loraplex.gpu_engine.lora.torch_backend import pool_rows

CASES = ((8, 1024), (128, 1024), (128, 512), (64, 2816), (16, 4096), (64, 14336))  # (rows, width)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=50)
    p.add_argument("--pool-mib", type=int, default=64, help="one pool layer's size")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    layer = torch.randn(args.pool_mib * 2**20 // 4, generator=g)
    rows = []
    for r, width in CASES:
        offsets = torch.randint(0, layer.numel() - width, (r,), generator=g)
        index = offsets[:, None] + torch.arange(width)[None, :]
        assert torch.equal(layer[index], pool_rows(layer, offsets, width))
        times: tuple[list[float], list[float]] = ([], [])
        for k in range(args.repeats):
            for i in ((0, 1) if k % 2 == 0 else (1, 0)):
                start = time.perf_counter()
                layer[index] if i == 0 else pool_rows(layer, offsets, width)
                times[i].append(time.perf_counter() - start)
        element, whole = (1e6 * statistics.median(t) for t in times)
        rows.append({"rows": r, "width": width, "element_gather_us": round(element, 1),
                     "row_gather_us": round(whole, 1), "speedup": round(element / whole, 2)})
        print(f"{r} x {width}: element {element:.0f} us, whole rows {whole:.0f} us", file=sys.stderr)
    print(json.dumps({"pool_mib": args.pool_mib, "threads": 1, "cases": rows}, indent=1) if args.json else rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
