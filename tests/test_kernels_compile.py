"""Every Triton kernel compiles for real GPUs (sm_90 and sm_80 cubins through Triton's bundled
ptxas, no GPU needed) at every launch configuration the engine can choose
(kernels/launch_space.py walks the launchers' own choice functions over the engine's domain),
on two Triton versions: this venv's and the lent GPU host's (`.venv-host`, `make venv-host`).

The interpreter runs kernels as Python and misses what only the compiler rejects
(loop-carried type changes, branch-typed pointers, dot shapes, shared memory over the
limit); this catches those on CPU-only machines, and holds the decode kernels to no
register spills. bf16 (the engine's CUDA default) runs by default; fp16 and fp32 compile
the same tiles with other element types, under `slow` (bench/kernel_compile.py runs all).
"""
from __future__ import annotations

import importlib
import inspect
import sys
from pathlib import Path

import pytest
import torch

from loraplex.kernels import launch_space
from loraplex.kernels.compile_check import DTYPE_NAMES, host_python, load_widths, occupancy, run

ROOT = Path(__file__).resolve().parents[1]
KERNEL_MODULES = ("lora_gemv", "lora_sgmv", "paged_attention_prefill", "paged_attention_decode")
DECODE_KERNELS = {"_gemv_shrink_kernel", "_gemv_expand_kernel", "_decode_split_kernel", "_decode_reduce_kernel"}


def _bundled_ptxas(python: Path) -> bool:
    return any((python.parent.parent / "lib").glob("python3*/site-packages/triton/backends/nvidia/bin/ptxas"))


def _interpreters() -> list[pytest.param]:
    main = Path(sys.executable)
    host = host_python(ROOT)
    return [
        pytest.param(main, id="main", marks=pytest.mark.skipif(
            not _bundled_ptxas(main), reason="this venv has no triton with its bundled ptxas")),
        pytest.param(host, id="host", marks=pytest.mark.skipif(
            host is None, reason="no .venv-host (the GPU host's torch 2.11 + triton 3.6): run `make venv-host`")),
    ]


def _check(python: Path, dtypes: list[str]) -> None:
    records = run([python], dtypes=dtypes, targets=(90, 80), jobs=2, cwd=ROOT)
    want = launch_space.distinct_launches([getattr(torch, DTYPE_NAMES[d]) for d in dtypes])
    names = {launch_space.launch_name(launch) for launch in want}
    for target in ("sm_90", "sm_80"):
        assert {r["name"] for r in records if r["target"] == target} == names, target
    failed = [f"{r['target']} {r['name']}: {r['error']}" for r in records if not r["ok"]]
    assert not failed, "\n".join(failed)
    over = [f"{r['target']} {r['name']}: {r['shared']} B > {r['shared_limit']} B" for r in records
            if not r["shared_ok"]]
    assert not over, "shared memory over the target's per-block limit:\n" + "\n".join(over)
    spills = [f"{r['target']} {r['name']}: {r['spill_stores']} B stored, {r['spill_loads']} B loaded"
              for r in records if r["kernel"] in DECODE_KERNELS and r["spill_stores"] + r["spill_loads"]]
    assert not spills, "decode kernels spill registers:\n" + "\n".join(spills)


@pytest.mark.parametrize("python", _interpreters())
def test_every_launch_compiles_for_sm90_sm80_bf16(python: Path) -> None:
    _check(python, ["bf16"])


@pytest.mark.slow
@pytest.mark.parametrize("python", _interpreters())
def test_every_launch_compiles_for_sm90_sm80_fp16_fp32(python: Path) -> None:
    _check(python, ["fp16", "fp32"])


# ---- the launch space itself (no compiler) ------------------------------------------------------
def test_every_kernel_is_in_the_launch_space() -> None:
    launched = {(launch.module, launch.kernel) for launch in launch_space.distinct_launches()}
    defined = set()
    for module in KERNEL_MODULES:
        mod = importlib.import_module(f"loraplex.kernels.{module}")
        defined |= {(module, name) for name, fn in vars(mod).items()
                    if name.endswith("_kernel") and hasattr(fn, "arg_names")}
    assert defined == launched
    assert set(launch_space.DIVISIBLE_INTS) == {kernel for _, kernel in defined}


def test_launch_space_names_real_arguments() -> None:
    for launch in launch_space.distinct_launches([torch.bfloat16]):
        fn = getattr(importlib.import_module(f"loraplex.kernels.{launch.module}"), launch.kernel)
        args = set(fn.arg_names)
        named = {*dict(launch.constexprs), *dict(launch.types), *launch_space.DIVISIBLE_INTS[launch.kernel]}
        assert named <= args, (launch.kernel, named - args)
        assert {a for a in args if a.endswith("_ptr")} <= set(dict(launch.types)), launch.kernel


def test_launch_space_follows_the_engine() -> None:
    from loraplex.contracts.engine_spec import DTYPES, EngineSpec
    from loraplex.gpu_engine.model.attention_triton import DEFAULT_SPLIT_TOKENS

    assert DEFAULT_SPLIT_TOKENS in launch_space.DECODE_SPLIT_TOKENS
    assert max(launch_space.LORA_RANKS) >= EngineSpec().max_lora_rank
    assert {str(d).removeprefix("torch.") for d in launch_space.DTYPES} == set(DTYPES) - {"auto"}
    assert EngineSpec().max_num_seqs in launch_space.DECODE_TOKENS
    assert all(p % 16 == 0 for p in launch_space.PAGE_TOKENS)  # DIVISIBLE_INTS counts on it
    assert all(d % 16 == 0 for d in launch_space.HEAD_DIMS)


def test_launch_space_dedupes_to_compile_keys() -> None:
    every = list(launch_space.engine_launches([torch.bfloat16]))
    distinct = launch_space.distinct_launches([torch.bfloat16])
    assert len(set(every)) == len(distinct) < len(every)
    assert len({launch_space.launch_name(launch) for launch in distinct}) == len(distinct)
    # the decode attention's choices, as the launcher makes them
    kernels = {launch.kernel for launch in distinct}
    assert {"_decode_split_kernel", "_decode_reduce_kernel", "_prefill_kernel"} <= kernels
    d_pads = {dict(launch.constexprs)["D_PAD"] for launch in distinct if launch.kernel == "_decode_split_kernel"}
    assert d_pads == {64, 128, 256}


def test_launchers_call_their_choice_functions() -> None:
    """A launcher that stops calling its choice function would leave this check compiling a
    configuration the engine no longer launches."""
    from loraplex.kernels import lora_gemv, lora_sgmv, paged_attention_decode, paged_attention_prefill

    for launcher, choice in ((lora_gemv.gemv_shrink, "gemv_shrink_launch("),
                             (lora_gemv.gemv_expand, "gemv_expand_launch("),
                             (lora_sgmv.sgmv_shrink, "sgmv_shrink_launch("),
                             (lora_sgmv.sgmv_expand, "sgmv_expand_launch("),
                             (paged_attention_prefill.paged_prefill_attention, "prefill_launch("),
                             (paged_attention_decode.paged_decode_attention, "decode_launch(")):
        source = inspect.getsource(launcher)
        assert choice in source and "**" in source and ".options" in source, launcher.__name__


def test_resource_arithmetic() -> None:
    assert occupancy(32, 4, 0, 228 * 1024) == 1.0  # 16 blocks of 4 warps
    assert occupancy(128, 4, 0, 228 * 1024) == 0.25  # 128 x 32 x 4 = 16384 registers a block: 4 blocks
    assert occupancy(255, 4, 0, 228 * 1024) == 0.125
    assert occupancy(32, 4, 100 * 1024, 228 * 1024) == 2 * 4 / 64  # shared memory: 2 blocks
    ptx = ("ld.global.v4.b32 { %r1, %r2, %r3, %r4 }, [ %rd1 + 0 ];\n@%p1 ld.global.b16 { %rs1 }, [ %rd2 + 0 ];\n"
           "ld.global.L1::evict_last.v2.b32 { %r5, %r6 }, [ %rd3 + 0 ];\n")
    assert load_widths(ptx) == {"2": 1, "8": 1, "16": 1}
