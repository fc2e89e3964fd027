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
    ref = lora_delta_reference(x, a, bt, scaling)  # from the same (rounded) store weights
    # fp32 accumulation over in + rank terms of O(1) products.
    tol = 1e-5 * math.sqrt(in_f + rank) * max(1.0, ref.abs().max().item())
    err = (out.double() - ref).abs().max().item()
    assert err <= tol, f"seed {seed}: max error {err} > {tol}"


def test_writes_only_its_rows_of_a_larger_buffer() -> None:
    x, a, bt = random_case(10, 32, 24, 4, torch.float32, 1)
    region = torch.full((30, 24), -7.0)  # [max_tokens, out] like an exchange out region
    lora_delta(x[2:6], a, bt, 0.5, region[11:15])
    assert torch.equal(region[:11], torch.full((11, 24), -7.0))
    assert torch.equal(region[15:], torch.full((15, 24), -7.0))
    torch.testing.assert_close(region[11:15].double(), lora_delta_reference(x[2:6], a, bt, 0.5))


def test_scaling_one_and_zero() -> None:
    x, a, bt = random_case(4, 8, 8, 2, torch.float32, 2)
    out = torch.empty(4, 8)
    torch.testing.assert_close(lora_delta(x, a, bt, 1.0, out).double(), lora_delta_reference(x, a, bt, 1.0))
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
