"""Kernel microbenchmarks: BGMV / MBGMV effective bandwidth against a measured
device-to-device copy and a torch gather+bmm baseline, SGMV TFLOP/s, and the
paged attention kernels (decode and prefill) against their roofline (KV bytes
over the measured copy bandwidth; FLOPs over a measured dense matmul) and
against torch's fused SDPA on contiguous KV of the same shapes, which is what
reading KV through the unified pool's page tables costs.

GPU figures come from a CUDA run (`--device cuda`); `--device cpu --interpret
--small` runs the same code under Triton's interpreter at tiny sizes, for smoke
tests only: its timings say nothing about the kernels. Prints a table, or with
`--json` one JSON object on stdout; progress goes to stderr.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

MIXED = "mixed"  # rows cycle through the numeric --ranks values: heterogeneous ranks in one batch


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    p.add_argument("--interpret", action="store_true", help="set TRITON_INTERPRET=1 (needed on cpu)")
    p.add_argument("--small", action="store_true", help="tiny sizes, one repeat: a smoke run")
    p.add_argument("--dtype", choices=("float16", "bfloat16", "float32"), default=None,
                   help="default: float16 on cuda, float32 on cpu")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 4, 16, 64])
    p.add_argument("--ranks", nargs="+", default=["8", "16", "32", "64", "128", MIXED])
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=20, help="timed samples (median reported)")
    p.add_argument("--iters", type=int, default=10, help="launches per timed sample")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    args = p.parse_args(argv)
    if args.small:
        args.batch, args.ranks, args.hidden, args.repeats, args.iters = [1, 3], ["4", "16", MIXED], 64, 1, 1
    if args.interpret:
        os.environ["TRITON_INTERPRET"] = "1"  # before loraplex.kernels imports triton
    return args


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        import torch

        self.torch = torch
        self.args = args
        self.device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        default = "float16" if self.device.type == "cuda" else "float32"
        self.dtype = getattr(torch, args.dtype or default)
        self.elem = torch.empty((), dtype=self.dtype).element_size()

    def time(self, fn: Callable[[], object]) -> float:
        """Median seconds of one call over --repeats samples of --iters calls, after one warm-up."""
        torch, cuda = self.torch, self.device.type == "cuda"
        fn()
        samples = []
        for _ in range(self.args.repeats):
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(self.args.iters):
                    fn()
                end.record()
                end.synchronize()
                samples.append(start.elapsed_time(end) / 1e3 / self.args.iters)
            else:
                t0 = time.perf_counter()
                for _ in range(self.args.iters):
                    fn()
                samples.append((time.perf_counter() - t0) / self.args.iters)
        return statistics.median(samples)

    def copy_gb_s(self) -> float:
        n = (4 << 20 if self.args.small else 512 << 20) // self.elem
        src = self.torch.randn(n, device=self.device).to(self.dtype)
        dst = self.torch.empty_like(src)
        return 2 * n * self.elem / self.time(lambda: dst.copy_(src)) / 1e9  # read + write

    def adapters(self, ranks: list[int], hidden: int):
        """One adapter per entry, every A/B^T row at a shuffled row of a flat pool -> flat, tables, row ids."""
        from loraplex.kernels.lora_tables import build_tables

        torch = self.torch
        total = 2 * sum(ranks)
        order = torch.randperm(total + 1)  # row 0 of the order is left zero for padded baselines
        flat = (torch.randn((total + 1) * hidden, device=self.device) * 0.05).to(self.dtype)
        flat.view(total + 1, hidden)[int(order[-1])] = 0
        rows, ids, k = [], [], 0
        for r in ranks:
            a, b = order[k: k + r].tolist(), order[k + r: k + 2 * r].tolist()
            k += 2 * r
            rows.append(([i * hidden for i in a], [i * hidden for i in b]))
            ids.append((a, b))
        tables = build_tables([rows], [0.5] * len(ranks), self.device)
        return flat, tables, ids, int(order[-1])

    def gemv(self, batch: int, rank: str) -> dict[str, Any]:
        from loraplex.kernels import lora_bgmv, lora_mbgmv

        torch, h = self.torch, self.args.hidden
        cycle = sorted({int(r) for r in self.args.ranks if r != MIXED}) or [8, 16, 32, 64, 128]
        ranks = [cycle[i % len(cycle)] for i in range(batch)] if rank == MIXED else [int(rank)] * batch
        flat, tables, ids, zero = self.adapters(ranks, h)
        x = torch.randn(batch, h, device=self.device).to(self.dtype)
        out = torch.zeros(batch, h, device=self.device, dtype=self.dtype)
        slot = torch.arange(batch, dtype=torch.int32, device=self.device)  # every row its own adapter
        rmax = max(ranks)
        padded = [[rows + [zero] * (rmax - len(rows)) for rows in side] for side in zip(*ids)]
        a_ids, b_ids = (torch.tensor(p, device=self.device) for p in padded)  # [B, rmax] row ids, zero-padded
        rows2d = flat.view(-1, h)

        def torch_gather_bmm() -> None:  # baseline: gather the rows into contiguous buffers, then bmm
            a = rows2d.index_select(0, a_ids.flatten()).view(batch, rmax, h)
            bt = rows2d.index_select(0, b_ids.flatten()).view(batch, rmax, h)
            y = torch.bmm(x[:, None, :], a.transpose(1, 2))
            out.add_(torch.bmm(y, bt)[:, 0] * 0.5)

        def run(mod, shrink: str, expand: str) -> Callable[[], None]:
            return lambda: getattr(mod, expand)([out], getattr(mod, shrink)(x, flat, slot, tables), flat, slot,
                                                tables)

        nbytes = (sum(ranks) * 2 * h + 3 * batch * h) * self.elem  # weights once, x, out read + write
        res: dict[str, Any] = {"batch": batch, "rank": rank, "ranks_sum": sum(ranks), "hidden": h, "bytes": nbytes}
        for name, fn in (("bgmv", run(lora_bgmv, "bgmv_shrink", "bgmv_expand")),
                         ("mbgmv", run(lora_mbgmv, "mbgmv_shrink", "mbgmv_expand")), ("torch", torch_gather_bmm)):
            seconds = self.time(fn)
            res[f"{name}_s"], res[f"{name}_gb_s"] = seconds, nbytes / seconds / 1e9
        return res

    def sgmv(self, segments: int, seg_tokens: int, rank: int) -> dict[str, Any]:
        from loraplex.kernels import lora_sgmv

        torch, h = self.torch, self.args.hidden
        flat, tables, ids, _ = self.adapters([rank] * segments, h)
        tokens = segments * seg_tokens
        x = torch.randn(tokens, h, device=self.device).to(self.dtype)
        out = torch.zeros(tokens, h, device=self.device, dtype=self.dtype)
        i32 = dict(dtype=torch.int32, device=self.device)
        start = torch.arange(segments, **i32) * seg_tokens
        length = torch.full((segments,), seg_tokens, **i32)
        slot = torch.arange(segments, **i32)
        rows2d = flat.view(-1, h)
        a_ids, b_ids = (torch.tensor([p[j] for p in ids], device=self.device) for j in (0, 1))

        def triton_sgmv() -> None:
            y = lora_sgmv.sgmv_shrink(x, flat, start, length, slot, tables, seg_tokens)
            lora_sgmv.sgmv_expand([out], y, flat, start, length, slot, tables, seg_tokens)

        def torch_gather_mm() -> None:
            a = rows2d.index_select(0, a_ids.flatten()).view(segments, rank, h)
            bt = rows2d.index_select(0, b_ids.flatten()).view(segments, rank, h)
            xs = x.view(segments, seg_tokens, h)
            out.view(segments, seg_tokens, h).add_(torch.bmm(torch.bmm(xs, a.transpose(1, 2)), bt) * 0.5)

        flops = 2 * tokens * rank * 2 * h
        res: dict[str, Any] = {"segments": segments, "tokens": tokens, "rank": rank, "hidden": h}
        for name, fn in (("sgmv", triton_sgmv), ("torch", torch_gather_mm)):
            seconds = self.time(fn)
            res[f"{name}_s"], res[f"{name}_tflop_s"] = seconds, flops / seconds / 1e12
        return res

    def matmul_tflop_s(self) -> float:
        """Dense matmul throughput at this dtype: the compute roof of prefill attention."""
        n = 256 if self.args.small else 8192
        a = self.torch.randn(n, n, device=self.device).to(self.dtype)
        b = self.torch.randn(n, n, device=self.device).to(self.dtype)
        return 2 * n ** 3 / self.time(lambda: a @ b) / 1e12

    def sdpa_s(self, q, k, v, *, causal: bool) -> float:
        """torch's fused SDPA on contiguous KV. q: [B, H, Lq, D]; k, v: [B, KVH, Lk, D]."""
        f = self.torch.nn.functional.scaled_dot_product_attention
        group = q.shape[1] // k.shape[1]
        if group > 1:  # older torch has no enable_gqa: expand the KV heads once, outside the timing
            k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        return self.time(lambda: f(q, k, v, is_causal=causal))

    def decode(self, batch: int, context: int, heads: int, kv_heads: int, head_dim: int,
               copy_gb_s: float) -> dict[str, Any]:
        from loraplex.kernels.paged_attention_decode import paged_decode_attention
        from loraplex.kernels.paged_kv import build_rows

        torch, pt = self.torch, 16
        per_row = -(-context // pt)
        pages = torch.randperm(batch * per_row).view(batch, per_row).tolist()  # shuffled page tables
        kv = torch.randn(batch * per_row, pt * 2 * kv_heads * head_dim, device=self.device).to(self.dtype)
        rows = build_rows([(i, 1, context - 1, pages[i]) for i in range(batch)], self.device)
        q = torch.randn(batch, heads, head_dim, device=self.device).to(self.dtype)
        out = torch.empty_like(q)
        seconds = self.time(lambda: paged_decode_attention(q, kv, rows, num_kv_heads=kv_heads, page_tokens=pt,
                                                           out=out))
        k, v = (torch.randn(batch, kv_heads, context, head_dim, device=self.device).to(self.dtype) for _ in range(2))
        sdpa = self.sdpa_s(q[:, :, None, :], k, v, causal=False)
        kv_bytes = batch * context * 2 * kv_heads * head_dim * self.elem
        roof = kv_bytes / (copy_gb_s * 1e9)  # decode reads all KV once: bandwidth-bound
        return {"batch": batch, "context": context, "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim,
                "page_tokens": pt, "s": seconds, "kv_gb_s": kv_bytes / seconds / 1e9, "sdpa_s": sdpa,
                "roofline_s": roof, "frac_of_roofline": roof / seconds, "paged_over_sdpa": seconds / sdpa}

    def prefill(self, seqs: int, prompt: int, heads: int, kv_heads: int, head_dim: int,
                tflop_s: float) -> dict[str, Any]:
        from loraplex.kernels.paged_attention_prefill import paged_prefill_attention
        from loraplex.kernels.paged_kv import build_rows

        torch, pt = self.torch, 16
        per_row = -(-prompt // pt)
        pages = torch.randperm(seqs * per_row).view(seqs, per_row).tolist()
        kv = torch.randn(seqs * per_row, pt * 2 * kv_heads * head_dim, device=self.device).to(self.dtype)
        rows = build_rows([(i * prompt, prompt, 0, pages[i]) for i in range(seqs)], self.device)
        q = torch.randn(seqs * prompt, heads, head_dim, device=self.device).to(self.dtype)  # [T, H, D]
        seconds = self.time(lambda: paged_prefill_attention(q, kv, rows, num_kv_heads=kv_heads, page_tokens=pt))
        qc = q.view(seqs, prompt, heads, head_dim).transpose(1, 2)
        k, v = (torch.randn(seqs, kv_heads, prompt, head_dim, device=self.device).to(self.dtype) for _ in range(2))
        sdpa = self.sdpa_s(qc, k, v, causal=True)
        flops = 4 * seqs * heads * head_dim * prompt * (prompt + 1) / 2  # QK^T and PV over the causal half
        roof = flops / (tflop_s * 1e12)
        return {"seqs": seqs, "prompt": prompt, "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim,
                "page_tokens": pt, "s": seconds, "tflop_s": flops / seconds / 1e12, "sdpa_s": sdpa,
                "roofline_s": roof, "frac_of_roofline": roof / seconds, "paged_over_sdpa": seconds / sdpa}


def environment(bench: Bench) -> dict[str, Any]:
    import torch
    import triton

    cuda = bench.device.type == "cuda"
    return {"torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version(),
            "device": str(bench.device), "device_name": torch.cuda.get_device_name(bench.device) if cuda
            else platform.processor() or platform.machine(), "dtype": str(bench.dtype).replace("torch.", ""),
            "interpret": os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"),
            "timings_meaningful": cuda and os.environ.get("TRITON_INTERPRET", "0") in ("", "0")}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    bench = Bench(args)
    from loraplex.kernels.runtime import triton_unavailable_reason

    if bench.device.type == "cpu" and not args.interpret:
        log("on cpu the kernels need --interpret")
        return 2
    reason = triton_unavailable_reason()
    if reason is not None:
        log(reason)
        return 2
    log(f"device {bench.device}, dtype {bench.dtype}")
    report: dict[str, Any] = {"benchmark": "kernels", "env": environment(bench),
                              "config": {"batch": args.batch, "ranks": args.ranks, "hidden": args.hidden,
                                         "repeats": args.repeats, "iters": args.iters, "small": args.small}}
    report["copy_gb_s"] = bench.copy_gb_s()
    report["gemv"] = []
    for batch in args.batch:
        for rank in args.ranks:
            log(f"gemv batch {batch} rank {rank}")
            row = bench.gemv(batch, rank)
            for k in ("bgmv", "mbgmv", "torch"):
                row[f"{k}_frac_of_copy"] = row[f"{k}_gb_s"] / report["copy_gb_s"]
            report["gemv"].append(row)
    sgmv_cases = [(2, 8, 8)] if args.small else [(4, 512, 16), (4, 512, 64), (16, 256, 128)]
    report["sgmv"] = [bench.sgmv(*case) for case in sgmv_cases]
    decode_cases = [(2, 24, 4, 2, 16)] if args.small else [(1, 4096, 32, 8, 128), (16, 1024, 32, 8, 128),
                                                           (64, 1024, 32, 8, 128), (64, 4096, 32, 8, 128)]
    report["attention_decode"] = [bench.decode(*case, report["copy_gb_s"]) for case in decode_cases]
    report["matmul_tflop_s"] = bench.matmul_tflop_s()
    prefill_cases = [(2, 12, 4, 2, 16)] if args.small else [(1, 4096, 32, 8, 128), (4, 1024, 32, 8, 128),
                                                            (16, 512, 32, 32, 128)]
    report["attention_prefill"] = []
    for case in prefill_cases:
        log(f"prefill attention {case[0]} x {case[1]} tokens")
        report["attention_prefill"].append(bench.prefill(*case, report["matmul_tflop_s"]))
    if args.json:
        print(json.dumps(report, allow_nan=False))
    else:
        print_table(report)
    return 0


def print_table(report: dict[str, Any]) -> None:
    env = report["env"]
    print(f"{env['device']} ({env['device_name']}) {env['dtype']} triton {env['triton']}"
          f"{'  INTERPRETED: timings meaningless' if env['interpret'] else ''}")
    print(f"device-to-device copy: {report['copy_gb_s']:.1f} GB/s")
    print(f"{'batch':>5} {'rank':>6} {'bgmv GB/s':>10} {'mbgmv GB/s':>11} {'torch GB/s':>11} {'bgmv/copy':>10}")
    for r in report["gemv"]:
        print(f"{r['batch']:>5} {r['rank']:>6} {r['bgmv_gb_s']:>10.1f} {r['mbgmv_gb_s']:>11.1f} "
              f"{r['torch_gb_s']:>11.1f} {r['bgmv_frac_of_copy']:>10.2f}")
    for r in report["sgmv"]:
        print(f"sgmv {r['segments']}x{r['tokens'] // r['segments']} tokens rank {r['rank']}: "
              f"{r['sgmv_tflop_s']:.2f} TFLOP/s (torch gather+bmm {r['torch_tflop_s']:.2f})")
    for r in report["attention_decode"]:
        print(f"decode batch {r['batch']} context {r['context']}: {r['s'] * 1e3:.3f} ms, KV {r['kv_gb_s']:.1f} GB/s, "
              f"{r['frac_of_roofline']:.2f} of roofline, {r['paged_over_sdpa']:.2f}x SDPA")
    for r in report["attention_prefill"]:
        print(f"prefill {r['seqs']} x {r['prompt']}: {r['s'] * 1e3:.3f} ms, {r['tflop_s']:.1f} TFLOP/s, "
              f"{r['frac_of_roofline']:.2f} of roofline, {r['paged_over_sdpa']:.2f}x SDPA")


if __name__ == "__main__":
    sys.exit(main())
