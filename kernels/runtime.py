"""Where Triton kernels may run, and the argument checks every launcher shares.

Owns the policy "CUDA, or CPU under TRITON_INTERPRET=1" and turns every bad
shape, stride, dtype or device into a `ValueError` naming the argument. Never
imports triton at module import time: callers without triton still import this.
"""
from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INDEX_DTYPES = (torch.int32, torch.int64)
TRITON_TYPES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32", torch.int32: "i32",
                torch.int64: "i64"}


@dataclass(frozen=True, slots=True)
class KernelLaunch:
    """What a launcher chose for one kernel: constexprs, argument types and launch options.

    The launcher launches with it (`kernel[grid](*args, **launch.options)`); the compile check
    (kernels/launch_space.py) compiles every one the engine can choose. Hashable: it is the
    compile key, so launches that would build the same binary compare equal.
    """

    module: str  # the kernels module holding the @triton.jit function, e.g. "lora_gemv"
    kernel: str  # the function's name
    constexprs: tuple[tuple[str, object], ...]
    types: tuple[tuple[str, str], ...]  # non-i32 arguments: pointers ("*bf16") and floats ("fp32")
    num_warps: int = 4
    num_stages: int = 3

    @property
    def options(self) -> dict[str, object]:
        return {**dict(self.constexprs), "num_warps": self.num_warps, "num_stages": self.num_stages}

    def const(self, name: str) -> object:
        return dict(self.constexprs)[name]


def kernel_launch(module: str, kernel: str, constexprs: Mapping[str, object], pointers: Mapping[str, torch.dtype],
                  *, floats: Sequence[str] = (), num_warps: int = 4, num_stages: int = 3) -> KernelLaunch:
    """A KernelLaunch from torch dtypes of the pointer arguments; `floats` are fp32 scalars."""
    types = {name: "*" + TRITON_TYPES[dtype] for name, dtype in pointers.items()}
    types.update({name: "fp32" for name in floats})
    return KernelLaunch(module, kernel, tuple(constexprs.items()), tuple(sorted(types.items())), num_warps,
                        num_stages)


def interpret_mode() -> bool:
    """True when Triton runs kernels in its CPU interpreter (read by `triton.jit` at decoration)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def triton_unavailable_reason() -> str | None:
    """Why the Triton kernels cannot run in this process, or None when they can."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return "triton is not installed; install it (pip install triton) or use lora_backend='torch'"
    if not interpret_mode() and not torch.cuda.is_available():
        return ("Triton kernels need a CUDA GPU; on CPU set TRITON_INTERPRET=1 in the environment before "
                "loraplex starts (slow, for tests) or use lora_backend='torch'")
    return None


def require_triton() -> None:
    """Raise a ValueError saying what to do when the Triton kernels cannot run here."""
    reason = triton_unavailable_reason()
    if reason is not None:
        raise ValueError(reason)


def _interpreted(kernel: object) -> bool:
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(kernel, InterpretedFunction)


def check_device(*tensors: torch.Tensor, kernel: object | None = None) -> torch.device:
    """All tensors on one device that Triton can launch `kernel` on; returns it."""
    device = tensors[0].device
    for t in tensors:
        if t.device != device:
            raise ValueError(f"all tensors must be on one device, got {device} and {t.device}")
    if device.type == "cpu" and not interpret_mode():
        raise ValueError("CPU tensors need TRITON_INTERPRET=1 (Triton's interpreter); use a CUDA device otherwise")
    if device.type == "cpu" and kernel is not None and not _interpreted(kernel):
        raise ValueError("the kernels were imported before TRITON_INTERPRET=1 was set; set it before importing "
                         "loraplex.kernels")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"unsupported device {device}")
    return device


def check_tensor(name: str, t: torch.Tensor, *, ndim: int, dtypes: Sequence[torch.dtype],
                 shape: Sequence[int | None] | None = None, unit_last_stride: bool = True) -> None:
    """Rank, dtype, optional shape (None = any) and a unit innermost stride."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        raise ValueError(f"{name} must have dtype in {[str(d) for d in dtypes]}, got {t.dtype}")
    if shape is not None:
        for axis, (want, got) in enumerate(zip(shape, t.shape)):
            if want is not None and want != got:
                raise ValueError(f"{name} must have size {want} on axis {axis}, got shape {tuple(t.shape)}")
    if unit_last_stride and t.numel() > 0 and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dimension, got strides {t.stride()}")


def check_contiguous(name: str, t: torch.Tensor) -> None:
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous, got strides {t.stride()} for shape {tuple(t.shape)}")


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def block_default(gpu: int, interpreted: int, on_interpreter: bool | None = None) -> int:
    """A tile size: the GPU's, or a larger one under the interpreter, whose cost is per operation.

    on_interpreter: which of the two (None: this process's TRITON_INTERPRET)."""
    if on_interpreter is None:
        on_interpreter = interpret_mode()
    return interpreted if on_interpreter else gpu


def check_blocks(device: torch.device, dot_min: int = 1, **blocks: int) -> None:
    """Tile sizes are powers of two (tl.arange); tiles fed to tl.dot need >= 16 on a GPU."""
    least = dot_min if device.type == "cuda" else 1
    for name, value in blocks.items():
        if value < least or value & (value - 1):
            raise ValueError(f"{name}={value} must be a power of two >= {least}")
