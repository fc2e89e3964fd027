"""Compile every launch of `launch_space` for real GPU targets (sm_90, sm_80) on a machine
without a GPU, and read each binary's resources: registers, spills, shared memory.

`run` starts one worker process per (Python interpreter, shard): a worker is this module run
as `python -m loraplex.kernels.compile_check`, without TRITON_INTERPRET (Triton decides at
import whether @triton.jit builds compilable kernels), with a private Triton cache so every
compile runs ptxas, whose `-v` log gives registers and spills (a compiled object holds them
only once a GPU driver loads it). Prints one JSON line per (launch, target); never launches.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

# (compute capability, max dynamic shared memory per block with opt-in, shared memory per SM) in bytes
TARGETS = {90: (227 * 1024, 228 * 1024), 80: (163 * 1024, 164 * 1024)}
REGS_PER_SM = 65536
MAX_WARPS_PER_SM = 64  # 2048 threads on sm_80 and sm_90
MAX_BLOCKS_PER_SM = 32
DTYPE_NAMES = {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32"}
PTXAS_PROPS = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
PTXAS_USED = re.compile(r"Used (\d+) registers")
PTXAS_SMEM = re.compile(r"(\d+) bytes smem")
PTX_LOAD = re.compile(r"\bld\.global((?:\.[\w:]+)+)")


def occupancy(registers: int, num_warps: int, shared: int, smem_per_sm: int) -> float:
    """Resident warps per SM over the 64 an SM holds, from registers (256-register allocation
    units per warp), shared memory (+1 KiB the driver reserves per block) and the block limits."""
    per_warp = -(-max(registers, 1) * 32 // 256) * 256
    by_regs = REGS_PER_SM // (per_warp * num_warps)
    by_smem = smem_per_sm // (shared + 1024)
    blocks = min(by_regs, by_smem, MAX_WARPS_PER_SM // num_warps, MAX_BLOCKS_PER_SM)
    return blocks * num_warps / MAX_WARPS_PER_SM


def load_widths(ptx: str) -> dict[str, int]:
    """Global load instructions in the PTX by bytes per instruction ("2": scalar 16-bit, "16": 128-bit)."""
    widths: dict[str, int] = {}
    for m in PTX_LOAD.finditer(ptx):
        parts = m.group(1).split(".")[1:]
        vec = next((int(p[1:]) for p in parts if re.fullmatch(r"v\d", p)), 1)
        bits = next((int(p[1:]) for p in reversed(parts) if re.fullmatch(r"[bfsu]\d+", p)), 0)
        key = str(vec * bits // 8)
        widths[key] = widths.get(key, 0) + 1
    return dict(sorted(widths.items(), key=lambda kv: int(kv[0])))


def _compile_one(launch: Any, cc: int) -> dict[str, Any]:
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from loraplex.kernels.launch_space import DIVISIBLE_INTS

    fn = getattr(importlib.import_module(f"loraplex.kernels.{launch.module}"), launch.kernel)
    consts, types = dict(launch.constexprs), dict(launch.types)
    divisible = DIVISIBLE_INTS[launch.kernel]
    unknown = (set(consts) | set(types) | set(divisible)) - set(fn.arg_names)
    if unknown:
        raise ValueError(f"{launch.kernel} has no argument(s) {sorted(unknown)}")
    signature = {a: "constexpr" if a in consts else types.get(a, "i32") for a in fn.arg_names}
    # the runtime's specialisation: 16-byte aligned pointers, ints that are multiples of 16
    attrs = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(fn.arg_names)
             if signature[a].startswith("*") or a in divisible}
    log = io.StringIO()
    start = time.perf_counter()
    with contextlib.redirect_stdout(log):  # TRITON_DUMP_PTXAS_LOG: Triton prints ptxas -v here
        compiled = triton.compile(ASTSource(fn, signature, consts, attrs), target=GPUTarget("cuda", cc, 32),
                                  options={"num_warps": launch.num_warps, "num_stages": launch.num_stages})
    seconds = time.perf_counter() - start
    text = log.getvalue()
    props, used = PTXAS_PROPS.search(text), PTXAS_USED.search(text)
    if props is None or used is None:
        raise RuntimeError(f"no ptxas -v report for {launch.kernel} (is the Triton cache private?):\n{text[-2000:]}")
    if "cubin" not in compiled.asm:
        raise RuntimeError(f"{launch.kernel}: no cubin")
    static_smem = PTXAS_SMEM.search(text)
    shared = int(compiled.metadata.shared) + (int(static_smem.group(1)) if static_smem else 0)
    registers = int(used.group(1))
    limit, per_sm = TARGETS[cc]
    return {"registers": registers, "stack_frame": int(props.group(1)), "spill_stores": int(props.group(2)),
            "spill_loads": int(props.group(3)), "shared": shared, "shared_limit": limit,
            "shared_ok": shared <= limit, "occupancy": occupancy(registers, launch.num_warps, shared, per_sm),
            "global_load_bytes": load_widths(compiled.asm["ptx"]), "seconds": round(seconds, 3)}


def worker(dtypes: Sequence[str], targets: Sequence[int], shard: int, shards: int) -> None:
    """Compile this shard's launches for every target; one JSON line each on stdout."""
    import torch
    import triton

    from loraplex.kernels.launch_space import distinct_launches, launch_name

    launches = distinct_launches([getattr(torch, DTYPE_NAMES[d]) for d in dtypes])
    for i, launch in enumerate(launches):
        if i % shards != shard:
            continue
        for cc in targets:
            row: dict[str, Any] = {"name": launch_name(launch), "kernel": launch.kernel, "target": f"sm_{cc}",
                                   "triton": triton.__version__, "constexprs": dict(launch.constexprs),
                                   "num_warps": launch.num_warps, "num_stages": launch.num_stages}
            try:
                row.update(ok=True, error=None, **_compile_one(launch, cc))
            except Exception as exc:  # noqa: BLE001 - a compile failure is a result here, reported whole
                row.update(ok=False, error=f"{type(exc).__name__}: {exc}"[-4000:])
            print(json.dumps(row), flush=True)
            print(f"{row['triton']} {row['target']} {row['name']}: "
                  f"{'ok' if row['ok'] else 'FAILED'}", file=sys.stderr, flush=True)


def host_python(root: Path) -> Path | None:
    """The lent GPU host's toolchain (`make venv-host`: torch 2.11 + triton 3.6), when built."""
    python = root / ".venv-host" / "bin" / "python"
    return python if python.exists() else None


def run(pythons: Sequence[str | Path], *, dtypes: Sequence[str], targets: Sequence[int] = (90, 80),
        jobs: int = 2, cwd: Path | None = None, timeout: float = 1800.0,
        progress: bool = False) -> list[dict[str, Any]]:
    """Every launch of `dtypes` compiled for `targets` by each interpreter, `jobs` workers at a time
    (each interpreter's launches split into `jobs` shards) -> one record per (interpreter, launch, target).
    progress: the workers' stderr (a line per compile) goes to this process's stderr.

    Raises RuntimeError when a worker dies (a failed compile is a record with ok False, not an error)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_DEFAULT_FP_FUSION="1", TRITON_DUMP_PTXAS_LOG="1")
    pending = [(i, str(py), shard) for i, py in enumerate(pythons) for shard in range(jobs)]
    running: list[tuple[subprocess.Popen[bytes], str, Any, Any]] = []
    records: list[dict[str, Any]] = []
    deadline = time.monotonic() + timeout
    with tempfile.TemporaryDirectory(prefix="loraplex-compile-") as tmp:
        def start(index: int, py: str, shard: int) -> None:
            out = tempfile.TemporaryFile(mode="w+", dir=tmp)  # a file: no pipe to fill while we wait
            err = None if progress else tempfile.TemporaryFile(mode="w+", dir=tmp)
            args = [py, "-m", "loraplex.kernels.compile_check", "--dtypes", *dtypes, "--targets",
                    *map(str, targets), "--shard", str(shard), "--shards", str(jobs)]
            cache = Path(tmp) / f"triton-cache-{index}-{shard}"
            proc = subprocess.Popen(args, cwd=cwd, env={**env, "TRITON_CACHE_DIR": str(cache)}, stdout=out,
                                    stderr=err)
            running.append((proc, py, out, err))

        while pending or running:
            while pending and len(running) < jobs:
                start(*pending.pop(0))
            proc, py, out, err = running.pop(0)
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            out.seek(0)
            if proc.returncode != 0:
                detail = "its stderr is above" if err is None else (err.seek(0), err.read()[-4000:])[1]
                raise RuntimeError(f"{py} compile worker exited {proc.returncode}:\n{detail}")
            for line in out.read().splitlines():
                records.append({"python": py, **json.loads(line)})
    return records


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="compile worker: one JSON line per (launch, target)")
    p.add_argument("--dtypes", nargs="+", choices=sorted(DTYPE_NAMES), default=["bf16"])
    p.add_argument("--targets", nargs="+", type=int, choices=sorted(TARGETS), default=[90, 80])
    p.add_argument("--shard", type=int, default=0)
    p.add_argument("--shards", type=int, default=1)
    args = p.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        p.error("run without TRITON_INTERPRET: the interpreter's kernels do not compile")
    os.environ.setdefault("TRITON_DUMP_PTXAS_LOG", "1")
    worker(args.dtypes, args.targets, args.shard, args.shards)
    return 0


if __name__ == "__main__":
    sys.exit(main())
