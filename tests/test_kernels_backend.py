"""`TritonLoraBackend` equals `TorchLoraBackend` on adapters placed in shuffled
pool pages: decode steps (BGMV / MBGMV), prefill segments (SGMV), every forced
kernel, the fused q/k/v launch, base-only tokens bit-exact, per-step metadata reuse.

Runs on CPU under TRITON_INTERPRET=1 (set before triton is imported).
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the first import of triton
pytest.importorskip("triton")

from loraplex.contracts.geometry import PageGeometry, plan_adapter_layout  # noqa: E402
from loraplex.gpu_engine.lora.backend import make_lora_backend  # noqa: E402
from loraplex.gpu_engine.lora.peft_adapter import AdapterSpec, HostAdapter  # noqa: E402
from loraplex.gpu_engine.lora.torch_backend import (  # noqa: E402
    LoraGroup,
    ResidentLora,
    TorchLoraBackend,
    place_adapter,
)
from loraplex.gpu_engine.lora.triton_backend import TritonLoraBackend  # noqa: E402
from loraplex.gpu_engine.pool import UnifiedPool  # noqa: E402
from tests.tolerances import assert_within, reduction_bound  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
SHAPES = {"q_proj": (40, 40), "k_proj": (40, 12), "v_proj": (40, 12), "o_proj": (40, 40),
          "gate_proj": (40, 56), "up_proj": (40, 56), "down_proj": (56, 40)}  # module -> (in, out)
ADAPTERS = {"r4": (4, ["q_proj", "v_proj"]), "r16": (16, list(SHAPES)), "r8": (8, ["k_proj", "down_proj"]),
            "r8b": (8, ["q_proj", "k_proj", "v_proj"])}


@pytest.fixture(scope="module")
def placed() -> tuple[UnifiedPool, dict[str, ResidentLora]]:
    geometry = PageGeometry(kv_dim=12, page_tokens=16, max_row_width=56)
    pool = UnifiedPool(2, 200, geometry, device=DEVICE, dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    free = torch.randperm(200, generator=g).tolist()  # adapters land on shuffled, non-contiguous pages
    resident = {}
    for name, (rank, targets) in ADAPTERS.items():
        a = [{m: torch.randn(rank, SHAPES[m][0], generator=g) for m in targets} for _ in range(2)]
        b = [{m: torch.randn(SHAPES[m][1], rank, generator=g) for m in targets} for _ in range(2)]
        host = HostAdapter(name, Path(name), AdapterSpec(rank, 2.0 * rank, name == "r8", tuple(targets)), a, b)
        layout = plan_adapter_layout(geometry, SHAPES, targets, rank)
        resident[name] = place_adapter(pool, host, layout, [free.pop() for _ in range(layout.num_pages)])
    return pool, resident


def check_lora(got: torch.Tensor, want: torch.Tensor, base: torch.Tensor, x: torch.Tensor, flat: torch.Tensor,
               module: str, groups: list[LoraGroup]) -> None:
    """The Triton backend against the torch one within the float32 bound of x·A (fan_in terms), ·B (the
    rank), the scaling and the add; the same computation on absolute values gives each sum of |terms|."""
    magnitude = base.abs()
    TorchLoraBackend().apply(magnitude, x.abs(), flat.abs(), module, groups)  # scalings are positive
    terms = SHAPES[module][0] + max(rank for rank, _ in ADAPTERS.values()) + 2
    assert_within(got, want, reduction_bound(magnitude, terms, torch.float32, computations=2), f"{module}: ")


def groups_of(resident: dict[str, ResidentLora], segments: list[tuple[str, int, int]]) -> list[LoraGroup]:
    return [LoraGroup(resident[name], start, end) for name, start, end in segments]


DECODE = [("r4", 1, 2), ("r16", 2, 3), ("r8", 3, 4), ("r8b", 5, 6)]  # tokens 0 and 4: base rows
DECODE_EQUAL_RANKS = [("r8", 0, 1), ("r8b", 2, 3)]
PREFILL = [("r4", 0, 5), ("r16", 5, 6), ("r8", 9, 20)]  # tokens 6..8: base rows


@pytest.mark.parametrize("segments,kernel,expected", [
    (DECODE, "auto", "mbgmv"), (DECODE_EQUAL_RANKS, "auto", "bgmv"), (PREFILL, "auto", "sgmv"),
    (DECODE, "bgmv", "bgmv"), (PREFILL, "mbgmv", "mbgmv"), (DECODE, "sgmv", "sgmv"),
])
def test_backend_matches_torch(placed, segments, kernel: str, expected: str) -> None:
    pool, resident = placed
    groups = groups_of(resident, segments)
    tokens = max(end for _, _, end in segments) + 1
    covered = {t for _, s, e in segments for t in range(s, e)}
    backend = TritonLoraBackend(kernel=kernel)
    g = torch.Generator().manual_seed(tokens)
    for layer in (0, 1):
        flat = pool.layer_flat(layer)
        for module in ("q_proj", "k_proj", "down_proj"):
            fan_in, fan_out = SHAPES[module]
            x = torch.randn(tokens, fan_in, generator=g).to(DEVICE)
            base = torch.randn(tokens, fan_out, generator=g).to(DEVICE)
            want, got = base.clone(), base.clone()
            TorchLoraBackend().apply(want, x, flat, module, groups)
            backend.apply(got, x, flat, module, groups)
            check_lora(got, want, base, x, flat, module, groups)
            for t in set(range(tokens)) - covered:
                assert torch.equal(got[t], base[t]), f"{module}: base-only token {t} changed"
    assert backend._step is not None and backend._step.kernel == expected


def test_fused_qkv_equals_separate_launches_and_reuses_step(placed) -> None:
    pool, resident = placed
    groups = groups_of(resident, PREFILL)
    flat = pool.layer_flat(1)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(21, 40, generator=g).to(DEVICE)
    outs = [torch.randn(21, SHAPES[m][1], generator=g).to(DEVICE) for m in ("q_proj", "k_proj", "v_proj")]
    before = [o.clone() for o in outs]
    want = [o.clone() for o in outs]
    for o, m in zip(want, ("q_proj", "k_proj", "v_proj")):
        TorchLoraBackend().apply(o, x, flat, m, groups)
    backend = TritonLoraBackend()
    backend.apply_fused(outs, x, flat, ["q_proj", "k_proj", "v_proj"], groups)
    for a, b, base, m in zip(outs, want, before, ("q_proj", "k_proj", "v_proj")):
        check_lora(a, b, base, x, flat, m, groups)
    step = backend._step
    backend.apply(outs[0], x, flat, "o_proj", groups)  # same step: metadata built once
    assert backend._step is step and ("q_proj", "k_proj", "v_proj") in step.selected


def test_untargeted_module_and_no_groups_leave_output_exact(placed) -> None:
    pool, resident = placed
    backend = TritonLoraBackend()
    x = torch.randn(3, 40).to(DEVICE)
    out = torch.randn(3, 40).to(DEVICE)
    before = out.clone()
    backend.apply(out, x, pool.layer_flat(0), "o_proj", groups_of(resident, [("r4", 0, 3)]))  # r4: q, v only
    backend.apply(out, x, pool.layer_flat(0), "o_proj", [])
    assert torch.equal(out, before)


def test_factory_returns_triton_backend() -> None:
    assert isinstance(make_lora_backend("triton"), TritonLoraBackend)
    with pytest.raises(ValueError, match="kernel must be one of"):
        TritonLoraBackend(kernel="punica")


def test_rows_gathered_whole_are_the_placed_a_and_b(placed) -> None:
    """module_rows (whole-row gathers at offsets no row width divides) returns exactly the rows the
    element index names, which are the adapter's A and B^T as placed."""
    from loraplex.gpu_engine.lora.torch_backend import module_rows

    pool, resident = placed
    for layer in range(pool.data.shape[0]):
        flat = pool.layer_flat(layer)
        for lora in resident.values():
            for module, (idx_a, idx_b) in lora.index.items():
                a, bt = module_rows(flat, lora, module, 0), module_rows(flat, lora, module, 1)
                assert torch.equal(a, flat[idx_a]) and torch.equal(bt, flat[idx_b]), (lora.name, module)
                assert a.shape == (lora.rank, SHAPES[module][0]) and bt.shape == (lora.rank, SHAPES[module][1])
    offsets = torch.cat([off for lora in resident.values() for pair in lora.row_offsets.values() for off in pair])
    assert bool((offsets % 8 != 0).any()), "some rows start off any power-of-two boundary"
