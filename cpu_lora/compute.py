"""The single-threaded LoRA kernel of the CPU workers and of calibration.

Owns `lora_delta`: out = scaling · (x Aᵀ) Bᵀᵀ in float32, reading A and Bᵀ
straight from the host adapter store (float32, or bf16/fp16 converted on the
fly). Never sets thread counts and never allocates outputs: the caller owns
threading (one thread per worker) and hands in the destination rows.
"""
from __future__ import annotations

import torch

# Store dtypes the kernel reads; the exchange rows (x, out) are always float32.
STORE_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def store_dtype(name: str) -> torch.dtype:
    """The torch dtype of a store dtype name; ValueError for anything else."""
    try:
        return STORE_DTYPES[name]
    except KeyError:
        raise ValueError(f"unsupported store dtype {name!r}; expected one of {sorted(STORE_DTYPES)}") from None


def check_shapes(x: torch.Tensor, a: torch.Tensor, bt: torch.Tensor, out: torch.Tensor) -> None:
    """ValueError unless x [T, in] f32, a [r, in], bt [r, out], out [T, out] f32 contiguous."""
    if x.dim() != 2 or a.dim() != 2 or bt.dim() != 2 or out.dim() != 2:
        raise ValueError("lora_delta: x, a, bt and out must be 2-D")
    tokens, in_features = x.shape
    rank = a.shape[0]
    if a.shape[1] != in_features:
        raise ValueError(f"lora_delta: a is {tuple(a.shape)}, expected [r, {in_features}]")
    if bt.shape[0] != rank:
        raise ValueError(f"lora_delta: bt is {tuple(bt.shape)}, expected [{rank}, out]")
    if tuple(out.shape) != (tokens, bt.shape[1]):
        raise ValueError(f"lora_delta: out is {tuple(out.shape)}, expected [{tokens}, {bt.shape[1]}]")
    if x.dtype != torch.float32 or out.dtype != torch.float32:
        raise ValueError(f"lora_delta: x and out must be float32, got {x.dtype} and {out.dtype}")
    if a.dtype != bt.dtype or a.dtype not in STORE_DTYPES.values():
        raise ValueError(f"lora_delta: a and bt must share a store dtype, got {a.dtype} and {bt.dtype}")
    if not out.is_contiguous():
        raise ValueError("lora_delta: out must be contiguous (rows of the exchange buffer)")


def lora_delta(x: torch.Tensor, a: torch.Tensor, bt: torch.Tensor, scaling: float, out: torch.Tensor) -> torch.Tensor:
    """Write scaling · (x @ aᵀ) @ bt into `out` and return it.

    x: [T, in] float32; a: [r, in] and bt: [r, out] in the store dtype
    (row-major, as the host store lays them out); out: [T, out] float32,
    overwritten. Scaling is applied to the [T, r] intermediate, the smallest
    tensor on the path.
    """
    check_shapes(x, a, bt, out)
    if a.dtype != torch.float32:
        a = a.float()  # [r, in]: r·in elements, small next to the T·in·r product
        bt = bt.float()
    xa = torch.mm(x, a.t())  # [T, r]
    if scaling != 1.0:
        xa.mul_(scaling)
    torch.mm(xa, bt, out=out)  # [T, out]
    return out


def lora_delta_reference(x: torch.Tensor, a: torch.Tensor, bt: torch.Tensor, scaling: float) -> torch.Tensor:
    """float64 reference of lora_delta (for tests and benchmarks)."""
    return scaling * (x.double() @ a.double().t()) @ bt.double()
