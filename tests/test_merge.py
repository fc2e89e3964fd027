"""Merged-mode LoRA: merge then unmerge restores the base weights bit-exactly, and merged
outputs equal unmerged ones (offline engine on the demo model, float32)."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from loraplex import LLM, SamplingParams
from loraplex.gpu_engine.lora.merge import MergeController, merge_adapter, unmerge
from loraplex.gpu_engine.lora.peft_adapter import AdapterSpec, HostAdapter
from loraplex.gpu_engine.model.weights import LayerWeights, ModelWeights
from loraplex.ipc.engine_plan import RowPlan, SamplingSpec, StepPlan
from tests.tolerances import assert_within, reduction_bound, unit_roundoff

PROMPTS = [[5, 6, 7, 8, 9], [11, 3, 40, 2 + 7, 12, 13, 14, 15, 16, 17, 18], [21, 22]]
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, logprobs=True, ignore_eos=True)


def _snapshot(w: ModelWeights) -> dict[tuple[int, str], torch.Tensor]:
    return {(i, m): t.clone() for i, layer in enumerate(w.layers) for m, t in layer.proj.items()}


def _assert_same_weights(w: ModelWeights, snap: dict[tuple[int, str], torch.Tensor]) -> None:
    for (i, m), t in snap.items():
        assert torch.equal(w.layers[i].proj[m], t), (i, m)


def _assert_close(got, want, tol: float = 1e-4) -> None:
    for g, r in zip(got, want):
        assert g.token_ids == r.token_ids
        assert max(abs(a - b) for a, b in zip(g.logprobs, r.logprobs)) < tol


@pytest.fixture(scope="module")
def llm(demo):
    engine = LLM(demo.model_dir, num_pages=256)
    for name in ("all-r32", "rslora-r16"):
        engine.add_adapter(name, demo.adapters[name])
    return engine


def test_merged_outputs_equal_unmerged_and_unmerge_is_bit_exact(llm) -> None:
    w = llm.executor.model.w
    before = _snapshot(w)
    base = llm.generate(PROMPTS, adapters=None, sampling=GREEDY)
    for name in ("all-r32", "rslora-r16"):
        unmerged = llm.generate(PROMPTS, adapters=name, sampling=GREEDY)
        state = merge_adapter(w, llm.executor.host[name].adapter)
        assert not torch.equal(w.layers[0].proj["q_proj"], before[(0, "q_proj")])
        merged = llm.generate(PROMPTS, adapters=None, sampling=GREEDY)  # the LoRA now lives in W
        _assert_close(merged, unmerged)
        unmerge(state)
        _assert_same_weights(w, before)
    again = llm.generate(PROMPTS, adapters=None, sampling=GREEDY)
    assert [(o.token_ids, o.logprobs) for o in again] == [(o.token_ids, o.logprobs) for o in base]


def test_controller_runs_merged_plans_through_the_executor(llm) -> None:
    w = llm.executor.model.w
    before = _snapshot(w)
    unmerged = llm.generate(PROMPTS, adapters="all-r32", sampling=GREEDY)
    ctrl = llm.executor.merge  # the executor merges before each step as the plan asks
    execute = llm.executor.execute
    merged_plans = []

    def merged_execute(plan: StepPlan):  # a dLoRA plan: every row on the merged adapter
        plan = dataclasses.replace(plan, merged_adapter="all-r32")
        merged_plans.append(plan.step_id)
        return execute(plan)

    llm.executor.execute = merged_execute
    try:
        merged = llm.generate(PROMPTS, adapters="all-r32", sampling=GREEDY)
    finally:
        del llm.executor.execute
    assert merged_plans and ctrl.merged == "all-r32"
    _assert_close(merged, unmerged)
    assert ctrl.ensure("rslora-r16") > 0 and ctrl.merged == "rslora-r16"  # switches unmerge first
    ctrl.forget("rslora-r16")
    assert ctrl.merged is None
    _assert_same_weights(w, before)


def test_prepare_strips_the_merged_adapter_and_refuses_foreign_rows(llm) -> None:
    ctrl = MergeController(llm.executor.model.w, lambda name: llm.executor.host[name].adapter)

    def row(rid: str, adapter: str | None) -> RowPlan:
        return RowPlan(request_id=rid, token_ids=[1], start_pos=0, kv_pages=[0], adapter=adapter, sample=True,
                       sampling=SamplingSpec(), cpu_layers=2)

    rows = ctrl.prepare(StepPlan(step_id=0, rows=[row("a", "all-r32")], merged_adapter="all-r32"))
    assert [(r.adapter, r.cpu_layers) for r in rows] == [(None, 0)]
    with pytest.raises(ValueError, match="other adapters"):
        ctrl.prepare(StepPlan(step_id=1, rows=[row("a", "all-r32"), row("b", None)], merged_adapter="all-r32"))
    unchanged = [row("b", "rslora-r16")]
    assert ctrl.prepare(StepPlan(step_id=2, rows=unchanged)) == unchanged and ctrl.merged is None


def _toy(dtype: torch.dtype, device: str) -> tuple[ModelWeights, HostAdapter]:
    gen = torch.Generator().manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    layers = [LayerWeights(input_norm=rand(8), post_norm=rand(8), bias={},
                           proj={"q_proj": rand(8, 8), "v_proj": rand(4, 8), "o_proj": rand(8, 8)})
              for _ in range(2)]
    weights = ModelWeights(embed=rand(16, 8), layers=layers, norm=rand(8), lm_head=rand(16, 8))
    spec = AdapterSpec(rank=4, alpha=8.0, use_rslora=False, targets=("q_proj", "v_proj"))
    a = [{"q_proj": rand(4, 8), "v_proj": rand(4, 8)} for _ in range(2)]  # host copies: [r, in]
    b = [{"q_proj": rand(8, 4), "v_proj": rand(4, 4)} for _ in range(2)]  # [out, r]
    return weights, HostAdapter(name="toy", path=Path("."), spec=spec, a=a, b=b)


def _check_toy(dtype: torch.dtype, device: str) -> None:
    weights, adapter = _toy(dtype, device)
    before = _snapshot(weights)
    state = merge_adapter(weights, adapter)
    for (i, m), orig in before.items():
        if m in adapter.spec.targets:
            b, a, s = adapter.b[i][m].double(), adapter.a[i][m].double(), adapter.spec.scaling
            exact = orig.double() + b @ a * s
            # W + s·B·A summed in float32 over the rank (and the scaling and the add), then cast back:
            # the float32 sum's bound plus, in the 16-bit types, one rounding of each side to the dtype.
            magnitude = orig.double().abs() + b.abs() @ a.abs() * abs(s)
            bound = reduction_bound(magnitude, adapter.spec.rank + 2, torch.float32)
            if dtype != torch.float32:
                bound = bound + 2 * unit_roundoff(dtype) * magnitude
            assert_within(weights.layers[i].proj[m], exact, bound, f"layer {i} {m}: ")
            assert weights.layers[i].proj[m].dtype == dtype
        else:
            assert torch.equal(weights.layers[i].proj[m], orig)
    unmerge(state)
    _assert_same_weights(weights, before)
    assert not state.active


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_merge_adds_a_float32_delta_and_unmerge_restores_every_dtype(dtype) -> None:
    _check_toy(dtype, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_merge_on_gpu_keeps_originals_in_pinned_host_memory(dtype) -> None:
    _check_toy(dtype, "cuda")
    weights, adapter = _toy(dtype, "cuda")
    state = merge_adapter(weights, adapter)
    assert all(t.device.type == "cpu" and t.is_pinned() for _, _, t in state.saved)
    unmerge(state)
