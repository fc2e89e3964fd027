"""Numeric tolerances of the tests, derived from the dtype and the length of the
reductions, never picked to pass on one CPU (a SIMD width or a summation order
is the compiler's choice, not ours).

Two kinds of bound:
- elementwise, for one computation checked against a reference (a kernel, a
  merge, a LoRA delta): a sum of n products computed in a floating-point type in
  any order is within gamma_n * sum|terms| of the exact sum (Higham, "Accuracy and
  Stability of Numerical Algorithms", 3.1: gamma_n = n u / (1 - n u), u = eps / 2).
  `magnitude` is that sum of |terms| (the same computation on absolute values);
  two computations in the same dtype each carry the bound, so their difference
  carries twice it.
- a whole forward (logprobs of two runs of one model in float32: other kernels,
  another batch, ranks, graphs): worst-case bounds over thousands of chained
  reductions are vacuous, so the rounding is taken as a random walk: each of the n
  terms the forward's reductions add contributes an independent error of at most
  one ulp, growing as sqrt(n) ulps; `SIGMAS` of those.
"""
from __future__ import annotations

import math

import torch

# Standard deviations of the random walk a forward's rounding may drift by before a test fails.
SIGMAS = 16.0


def unit_roundoff(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps / 2


def gamma(n: int, dtype: torch.dtype) -> float:
    """Higham's gamma_n: the relative bound of a sum of n terms (or a dot product of length n)."""
    nu = n * unit_roundoff(dtype)
    if nu >= 1:
        raise ValueError(f"a reduction of {n} terms in {dtype} has no error bound")
    return nu / (1 - nu)


def reduction_bound(magnitude: torch.Tensor, n: int, dtype: torch.dtype, *, computations: int = 1) -> torch.Tensor:
    """The largest error of each element of a sum of n terms whose absolute values add up to `magnitude`,
    computed in `dtype`; `computations` of them compared with one another (2: kernel against a reference
    in the same dtype), plus the rounding of the result itself to `dtype`."""
    return (computations * gamma(n, dtype) + unit_roundoff(dtype)) * magnitude.abs()


def assert_within(got: torch.Tensor, want: torch.Tensor, bound: torch.Tensor | float, what: str = "") -> None:
    """Every element of got within `bound` (elementwise, or one number) of want; where want is infinite
    (a masked logit), got equals it."""
    got, want = got.double(), want.double()
    infinite = torch.isinf(want)
    if bool(infinite.any()):
        assert torch.equal(got[infinite], want[infinite]), f"{what}infinite elements differ"
        got, want = got.masked_fill(infinite, 0.0), want.masked_fill(infinite, 0.0)
    bound = torch.as_tensor(bound, dtype=torch.float64, device=got.device)
    # the smallest normal number: a bound of 0 (an exact zero term) still allows a denormal's difference
    slack = torch.finfo(torch.float32).tiny
    err = (got - want).abs()
    over = err > bound + slack
    if bool(over.any()):
        i = int(torch.argmax((err - bound).flatten()))
        raise AssertionError(f"{what}{int(over.sum())} of {err.numel()} elements over their bound; worst at flat "
                             f"index {i}: |{got.flatten()[i].item():.9g} - {want.flatten()[i].item():.9g}| = "
                             f"{err.flatten()[i].item():.3g} > {bound.expand_as(err).flatten()[i].item():.3g}")


def forward_terms(cfg) -> int:
    """Terms the reductions of one forward add along a token's path: each layer's projections (hidden
    in, intermediate in for the MLP's down projection) and the LM head's hidden once more."""
    return cfg.num_layers * (cfg.hidden_size + cfg.intermediate_size) + cfg.hidden_size


def forward_tolerance(cfg, dtype: torch.dtype = torch.float32) -> float:
    """How far a logprob of two forwards of one model in `dtype` may differ (module docstring): SIGMAS
    random-walk deviations of sqrt(n) ulps (about 1.2e-4 for the demo model in float32)."""
    return SIGMAS * torch.finfo(dtype).eps * math.sqrt(forward_terms(cfg))


def attention_bound(q: torch.Tensor, weighted_abs_v: torch.Tensor | float, *, k_norm_max: float, scale: float,
                    context: int, dtype: torch.dtype = torch.float32, computations: int = 2) -> torch.Tensor:
    """Elementwise bound of softmax attention computed in `dtype` (q [T, H, D]): each score q·k/sqrt(d)
    is off by at most gamma_{D+1}·scale·|q|·|k| <= gamma_{D+1}·scale·||q||·k_norm_max (a tanh soft-cap only
    shrinks that), which moves each softmax weight by a relative 2x that at most; the weights' sum and
    the weighted sum of V add gamma_{context+1} each, exp and the division a few u. The output's error is
    that relative error of the weighted |V| (`weighted_abs_v`: softmax(scores) @ |V|, or max|V|, which
    bounds it since the weights sum to 1)."""
    u = unit_roundoff(dtype)
    score = gamma(q.shape[-1] + 1, dtype) * scale * q.double().norm(dim=-1, keepdim=True) * k_norm_max
    relative = 2 * score + 2 * gamma(context + 1, dtype) + 4 * u
    return computations * relative * torch.as_tensor(weighted_abs_v, dtype=torch.float64, device=q.device)
