"""Where Triton kernels may run, and the argument checks every launcher shares.

Owns the policy "CUDA, or CPU under TRITON_INTERPRET=1" and turns every bad
shape, stride, dtype or device into a `ValueError` naming the argument. Never
imports triton at module import time: callers without triton still import this.
"""
from __future__ import annotations

import os
from collections.abc import Sequence

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INDEX_DTYPES = (torch.int32, torch.int64)


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


def block_default(gpu: int, interpreted: int) -> int:
    """A tile size: the GPU's, or a larger one under the interpreter, whose cost is per operation."""
    return interpreted if interpret_mode() else gpu


def check_blocks(device: torch.device, dot_min: int = 1, **blocks: int) -> None:
    """Tile sizes are powers of two (tl.arange); tiles fed to tl.dot need >= 16 on a GPU."""
    least = dot_min if device.type == "cuda" else 1
    for name, value in blocks.items():
        if value < least or value & (value - 1):
            raise ValueError(f"{name}={value} must be a power of two >= {least}")
