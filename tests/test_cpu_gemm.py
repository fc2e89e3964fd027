"""Packed CPU weights (gpu_engine/model/cpu_gemm.py) give F.linear's result within the float32
bound of a dot product, never a stale weight's after a change in place (as a dLoRA merge makes)
or a replaced tensor, and F.linear itself wherever packing does not apply; the engine built with
them answers as the one built without."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from loraplex.gpu_engine.model.cpu_gemm import PACKED_MIN_ROWS, CpuGemm, packed_linear_available
from tests.tolerances import assert_within, reduction_bound

needs_packing = pytest.mark.skipif(not packed_linear_available(), reason="this torch has no oneDNN linear ops")


def _within_dot_bound(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> None:
    want = F.linear(x.double(), w.double(), None if bias is None else bias.double())
    magnitude = F.linear(x.double().abs(), w.double().abs(), None if bias is None else bias.double().abs())
    assert_within(got, want, reduction_bound(magnitude, w.shape[1] + 1, torch.float32, computations=1))


@needs_packing
@pytest.mark.parametrize("rows", [4, 7, 16, 129])
def test_packed_projection_is_f_linear_within_the_float32_bound(rows: int) -> None:
    g = torch.Generator().manual_seed(rows)
    w, bias = torch.randn(96, 80, generator=g), torch.randn(96, generator=g)
    x = torch.randn(rows, 80, generator=g)
    gemm = CpuGemm()
    assert gemm.enabled
    _within_dot_bound(gemm.linear("site", x, w), x, w, None)
    _within_dot_bound(gemm.linear("biased", x, w, bias), x, w, bias)
    assert gemm.packed_weights == 2
    x3 = torch.randn(2, rows, 80, generator=g)  # leading dims, and a transposed (non-contiguous) input
    _within_dot_bound(gemm.linear("site", x3, w), x3, w, None)
    xt = torch.randn(80, rows, generator=g).t()
    _within_dot_bound(gemm.linear("site", xt, w), xt, w, None)
    assert gemm.linear("site", x[:0], w).shape == (0, 96)
    few = x[:PACKED_MIN_ROWS - 1]  # a row or two: F.linear's matrix-vector path, exactly
    assert torch.equal(gemm.linear("site", few, w), F.linear(few, w))


@needs_packing
def test_a_weight_changed_in_place_or_replaced_is_repacked() -> None:
    g = torch.Generator().manual_seed(1)
    w, x = torch.randn(64, 48, generator=g), torch.randn(5, 48, generator=g)
    gemm = CpuGemm()
    before = gemm.linear("site", x, w)
    delta = torch.randn(64, 4, generator=g) @ torch.randn(4, 48, generator=g)
    with torch.no_grad():
        w.copy_(w + delta)  # a merge: in place, as gpu_engine/lora/merge.py writes it
    after = gemm.linear("site", x, w)
    _within_dot_bound(after, x, w, None)
    assert (after - before).abs().max() > 1.0, "the merged weight's result, not the stale pack's"
    other = torch.randn(64, 48, generator=g)  # the site now holds another tensor (an untied LM head)
    _within_dot_bound(gemm.linear("site", x, other), x, other, None)
    assert gemm.packed_weights == 1, "one pack per site: replaced ones are dropped"


def test_where_packing_does_not_apply_it_is_f_linear_exactly() -> None:
    g = torch.Generator().manual_seed(2)
    w, x = torch.randn(32, 24, generator=g), torch.randn(3, 24, generator=g)
    off = CpuGemm(enabled=False)
    assert torch.equal(off.linear("s", x, w), F.linear(x, w)) and off.packed_weights == 0
    on = CpuGemm()
    wb, xb = w.bfloat16(), x.bfloat16()
    assert torch.equal(on.linear("s", xb, wb), F.linear(xb, wb)), "bfloat16 is not packed"
    with torch.inference_mode():
        frozen = torch.randn(32, 24)  # an inference tensor has no version counter: a change could not be seen
        xi = torch.randn(3, 24)
        assert torch.equal(on.linear("frozen", xi, frozen), F.linear(xi, frozen))
    assert on.packed_weights == 0


@needs_packing
def test_the_engine_answers_alike_with_and_without_packed_weights() -> None:
    from loraplex.gpu_engine.demo import builtin_demo
    from loraplex.offline import LLM, SamplingParams
    from tests.tolerances import forward_tolerance

    demo = builtin_demo()
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 200, (n,), generator=g).tolist() for n in (9, 4, 17)]
    adapters = [None, "all-r32", "rslora-r16"]
    params = SamplingParams(max_tokens=6, temperature=0.0, logprobs=True)
    results = {}
    for packed in (True, False):
        llm = LLM(demo.model_dir, cpu_packed_weights=packed)
        for name in adapters[1:]:
            llm.add_adapter(name, demo.adapters[name])
        assert llm.executor.model.gemm.enabled == packed
        results[packed] = llm.generate(prompts, adapters=adapters, sampling=params)
        assert (llm.executor.model.gemm.packed_weights > 0) == packed
    tol = forward_tolerance(llm.config)
    for on, off in zip(results[True], results[False]):
        assert on.token_ids == off.token_ids
        worst = max(abs(a - b) for a, b in zip(on.logprobs, off.logprobs))
        assert worst < tol, f"logprob difference {worst} over {tol:.2g}"
