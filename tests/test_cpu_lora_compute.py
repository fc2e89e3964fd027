"""cpu_lora.compute: the workers' single-thread LoRA kernel against a float64
reference on fresh random inputs (ranks, odd sizes, store dtypes), writing
only the rows it is given."""
from __future__ import annotations

import math

import pytest
import torch

from loraplex.cpu_lora.compute import lora_delta, lora_delta_reference, store_dtype

# (tokens, in, out, rank): odd sizes, rank 1, rank > in, a single token.
SHAPES = [(1, 16, 16, 8), (7, 19, 13, 3), (33, 96, 257, 16), (64, 128, 96, 64), (5, 40, 24, 128), (17, 64, 64, 1)]


def assert_within_float32_bound(got: torch.Tensor, x: torch.Tensor, a: torch.Tensor, bt: torch.Tensor,
                                scaling: float, seed: int | None = None) -> None:
    """Every element of the float32 result within the forward error bound of two float32 matrix
    products (each a sum of in, then rank, terms) against the float64 reference: (in + rank + 2)·eps
    times the same products of absolute values. Any summation order a SIMD path picks is inside it;
    a wrong row, rank or scaling is not."""
    want = lora_delta_reference(x, a, bt, scaling)
    magnitude = lora_delta_reference(x.abs(), a.abs(), bt.abs(), abs(scaling))
    bound = (x.shape[1] + a.shape[0] + 2) * torch.finfo(torch.float32).eps * magnitude
    excess = ((got.double() - want).abs() - bound).max().item()
    assert excess <= 0, f"seed {seed}: an element is {excess:.3g} beyond its float32 error bound"


def random_case(tokens: int, in_f: int, out_f: int, rank: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, in_f, generator=gen)
    a = (torch.randn(rank, in_f, generator=gen) / math.sqrt(in_f)).to(dtype)
    bt = (torch.randn(rank, out_f, generator=gen) / math.sqrt(rank)).to(dtype)
    return x, a, bt


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_matches_float64_reference(shape: tuple[int, int, int, int], dtype: str) -> None:
    tokens, in_f, out_f, rank = shape
    seed = int(torch.randint(0, 2**31 - 1, ()).item())  # fresh inputs every run; the seed is in the message
    x, a, bt = random_case(tokens, in_f, out_f, rank, store_dtype(dtype), seed)
    scaling = 1.7
    out = torch.full((tokens, out_f), float("nan"))  # every element must be overwritten
    result = lora_delta(x, a, bt, scaling, out)
    assert result is out
    assert_within_float32_bound(out, x, a, bt, scaling, seed)  # from the same (rounded) store weights


def test_writes_only_its_rows_of_a_larger_buffer() -> None:
    x, a, bt = random_case(10, 32, 24, 4, torch.float32, 1)
    region = torch.full((30, 24), -7.0)  # [max_tokens, out] like an exchange out region
    lora_delta(x[2:6], a, bt, 0.5, region[11:15])
    assert torch.equal(region[:11], torch.full((11, 24), -7.0))
    assert torch.equal(region[15:], torch.full((15, 24), -7.0))
    assert_within_float32_bound(region[11:15], x[2:6], a, bt, 0.5)


def test_scaling_one_and_zero() -> None:
    x, a, bt = random_case(4, 8, 8, 2, torch.float32, 2)
    out = torch.empty(4, 8)
    assert_within_float32_bound(lora_delta(x, a, bt, 1.0, out), x, a, bt, 1.0)
    assert torch.count_nonzero(lora_delta(x, a, bt, 0.0, out)) == 0


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda x, a, bt, out: (x, a[:, :-1], bt, out), "expected \\[r, 16\\]"),
        (lambda x, a, bt, out: (x, a, bt[:-1], out), "bt is"),
        (lambda x, a, bt, out: (x, a, bt, out[:, :-1]), "out is"),
        (lambda x, a, bt, out: (x.double(), a, bt, out), "float32"),
        (lambda x, a, bt, out: (x, a, bt.half(), out), "share a store dtype"),
        (lambda x, a, bt, out: (x, a, bt, torch.empty(12, 4).t()), "contiguous"),
        (lambda x, a, bt, out: (x[0], a, bt, out), "2-D"),
    ],
)
def test_rejects_bad_shapes_and_dtypes(change, match: str) -> None:
    x, a, bt = random_case(4, 16, 12, 4, torch.float32, 3)
    out = torch.empty(4, 12)
    with pytest.raises(ValueError, match=match):
        lora_delta(*change(x, a, bt, out)[:3], 1.0, change(x, a, bt, out)[3])


def test_unknown_store_dtype() -> None:
    with pytest.raises(ValueError, match="unsupported store dtype"):
        store_dtype("int8")
