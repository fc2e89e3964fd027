"""Every Triton kernel compiles for a real GPU (sm_90 cubin through Triton's
bundled ptxas), no GPU needed. The interpreter executes kernels as Python and
misses what only the compiler rejects (loop-carried type changes, branch-typed
pointers, dot shapes); this catches those on CPU-only machines.

The compile runs in a subprocess without TRITON_INTERPRET (it decides, at import,
whether @triton.jit builds compilable kernels); this file is that subprocess's script.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

LORA_PTRS = {"x_ptr": "{dt}", "flat_ptr": "{dt}", "slot_ptr": "i32", "a_off_ptr": "i64", "b_off_ptr": "i64",
             "rank_ptr": "i32", "y_ptr": "fp32", "scale_ptr": "fp32", "out0": "{dt}", "out1": "{dt}",
             "out2": "{dt}", "start_ptr": "i32", "len_ptr": "i32", "seg_slot_ptr": "i32"}
ATTN_PTRS = {"q_ptr": "{dt}", "kv_ptr": "{dt}", "out_ptr": "{dt}", "q_start_ptr": "i32", "q_len_ptr": "i32",
             "start_pos_ptr": "i32", "ctx_ptr": "i32", "table_ptr": "i32", "o_ptr": "fp32", "ml_ptr": "fp32"}
FLOATS = {"qk_scale"}
# (module, kernel, constexprs, pointer dtypes)
KERNELS = [
    # BGMV (PAD_TO_MAX) and MBGMV share one body
    ("lora_gemv", "_gemv_shrink_kernel", {"BLOCK_R": 16, "BLOCK_K": 256, "SPLIT_K": 4, "PAD_TO_MAX": True}, LORA_PTRS),
    ("lora_gemv", "_gemv_expand_kernel", {"BLOCK_R": 64, "BLOCK_N": 256, "PAD_TO_MAX": True}, LORA_PTRS),
    ("lora_gemv", "_gemv_shrink_kernel", {"BLOCK_R": 16, "BLOCK_K": 512, "SPLIT_K": 1, "PAD_TO_MAX": False},
     LORA_PTRS),
    ("lora_gemv", "_gemv_expand_kernel", {"BLOCK_R": 16, "BLOCK_N": 256, "PAD_TO_MAX": False}, LORA_PTRS),
    ("lora_sgmv", "_sgmv_shrink_kernel", {"BLOCK_M": 32, "BLOCK_R": 16, "BLOCK_K": 64, "PRECISION": "ieee"},
     LORA_PTRS),
    ("lora_sgmv", "_sgmv_expand_kernel", {"BLOCK_M": 32, "BLOCK_R": 64, "BLOCK_N": 64, "PRECISION": "ieee"},
     LORA_PTRS),
    ("paged_attention_prefill", "_prefill_kernel",
     {"BLOCK_M": 64, "BLOCK_N": 64, "D_PAD": 128, "PRECISION": "ieee"}, ATTN_PTRS),
    ("paged_attention_decode", "_decode_split_kernel",
     {"G_PAD": 16, "BLOCK_N": 64, "D_PAD": 128, "SINGLE": False, "PRECISION": "ieee"}, ATTN_PTRS),
    ("paged_attention_decode", "_decode_split_kernel",
     {"G_PAD": 16, "BLOCK_N": 64, "D_PAD": 128, "SINGLE": True, "PRECISION": "ieee"}, ATTN_PTRS),
    ("paged_attention_decode", "_decode_reduce_kernel", {"G_PAD": 16, "D_PAD": 128}, ATTN_PTRS),
]


def compile_all(dtypes: list[str]) -> None:
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target = GPUTarget("cuda", 90, 32)
    for dt in dtypes:
        for module, name, consts, ptrs in KERNELS:
            fn = getattr(importlib.import_module(f"loraplex.kernels.{module}"), name)
            sig = {}
            for arg in fn.arg_names:
                if arg in consts:
                    sig[arg] = "constexpr"
                elif arg in ptrs:
                    sig[arg] = "*" + ptrs[arg].format(dt=dt)
                else:
                    sig[arg] = "fp32" if arg in FLOATS else "i32"
            compiled = triton.compile(ASTSource(fn, sig, consts), target=target)
            if "cubin" not in compiled.asm:
                raise RuntimeError(f"{name} ({dt}): no cubin")
            print(f"ok {module}.{name} {dt}", flush=True)


def _bundled_ptxas() -> Path | None:
    try:
        import importlib.util

        spec = importlib.util.find_spec("triton")
    except ImportError:
        return None
    if spec is None or spec.origin is None:
        return None
    ptxas = Path(spec.origin).parent / "backends" / "nvidia" / "bin" / "ptxas"
    return ptxas if ptxas.exists() else None


needs_ptxas = pytest.mark.skipif(_bundled_ptxas() is None, reason="triton with its bundled ptxas is not installed")


def _run(dtypes: list[str]) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    proc = subprocess.run([sys.executable, __file__, *dtypes], env=env, capture_output=True, text=True,
                          timeout=300, check=False, cwd=Path(__file__).resolve().parents[1])
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.count("ok ") == len(KERNELS) * len(dtypes), proc.stdout


@needs_ptxas
def test_kernels_compile_for_sm90_bf16() -> None:
    _run(["bf16"])


@pytest.mark.slow
@needs_ptxas
def test_kernels_compile_for_sm90_fp32_fp16() -> None:
    _run(["fp32", "fp16"])


if __name__ == "__main__":
    compile_all(sys.argv[1:])
