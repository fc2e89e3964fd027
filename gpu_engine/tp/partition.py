"""Slice a model's weights and an adapter's A/B into one rank's shard, as the
tensor-parallel plan (loraplex.contracts.tensor_parallel) defines them.

Every rank keeps 1/N of each matrix: nothing of an adapter is replicated. The
shards are copies (contiguous), so a rank can drop the full tensors afterwards.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from loraplex.contracts.tensor_parallel import COLUMN_PARALLEL, TensorParallelPlan
from loraplex.gpu_engine.lora.peft_adapter import HostAdapter
from loraplex.gpu_engine.model.config import ModelConfig
from loraplex.gpu_engine.model.weights import LayerWeights, ModelWeights


def _slice(t: torch.Tensor, dim: int, rank: int, parts: int) -> torch.Tensor:
    size = t.shape[dim] // parts
    return t.narrow(dim, rank * size, size).contiguous()


def rank_config(cfg: ModelConfig, plan: TensorParallelPlan) -> ModelConfig:
    """The model as one rank sees it: its heads, its slice of the MLP and of the vocabulary."""
    return dataclasses.replace(cfg, num_heads=plan.heads, num_kv_heads=plan.kv_heads,
                               intermediate_size=cfg.intermediate_size // plan.world_size,
                               vocab_size=plan.vocab_shard)


def vocab_rows(t: torch.Tensor, plan: TensorParallelPlan, rank: int) -> torch.Tensor:
    """Rows [rank·V/N, (rank+1)·V/N) of a [vocab, hidden] matrix, zero rows past the vocabulary."""
    padded = plan.vocab_shard * plan.world_size
    if padded != t.shape[0]:
        t = F.pad(t, (0, 0, 0, padded - t.shape[0]))
    return _slice(t, 0, rank, plan.world_size)


def shard_weights(weights: ModelWeights, plan: TensorParallelPlan, rank: int) -> ModelWeights:
    """Megatron-LM: column-parallel projections (and their biases) split along out, row-parallel along in
    (their biases kept whole: added once, after the all-reduce); embedding and LM head by vocabulary."""
    n = plan.world_size
    layers = []
    for layer in weights.layers:
        proj = {name: _slice(w, 0 if name in COLUMN_PARALLEL else 1, rank, n) for name, w in layer.proj.items()}
        bias = {name: _slice(b, 0, rank, n) if name in COLUMN_PARALLEL else b for name, b in layer.bias.items()}
        layers.append(LayerWeights(input_norm=layer.input_norm, post_norm=layer.post_norm, proj=proj, bias=bias))
    embed = vocab_rows(weights.embed, plan, rank)
    lm_head = embed if weights.lm_head is weights.embed else vocab_rows(weights.lm_head, plan, rank)
    return ModelWeights(embed=embed, layers=layers, norm=weights.norm, lm_head=lm_head)


def shard_lora(module: str, a: torch.Tensor, b: torch.Tensor, plan: TensorParallelPlan,
               rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One rank's (A [rows, width], B [out/N, rows]) of a module's A [r, in], B [out, r] (S-LoRA §6.1)."""
    n = plan.world_size
    if module in COLUMN_PARALLEL:
        r_pad = plan.lora_rank_shard(a.shape[0]) * n
        a = F.pad(a, (0, 0, 0, r_pad - a.shape[0]))  # zero rows: x·A of the padding is zero
        b = F.pad(b, (0, r_pad - b.shape[1]))
        return _slice(a, 0, rank, n), _slice(b, 0, rank, n)
    return _slice(a, 1, rank, n), _slice(b, 0, rank, n)


def shard_adapter(adapter: HostAdapter, plan: TensorParallelPlan, rank: int) -> HostAdapter:
    """The adapter as one rank stores it: the same name and spec (rank, scaling), sliced A and B,
    in the shapes plan.adapter_layout packs (so the pool's copy and gather code runs unchanged)."""
    a_out: list[dict[str, torch.Tensor]] = []
    b_out: list[dict[str, torch.Tensor]] = []
    for a_layer, b_layer in zip(adapter.a, adapter.b):
        pairs = {m: shard_lora(m, a_layer[m], b_layer[m], plan, rank) for m in a_layer}
        a_out.append({m: p[0] for m, p in pairs.items()})
        b_out.append({m: p[1] for m, p in pairs.items()})
    return HostAdapter(name=adapter.name, path=adapter.path, spec=adapter.spec, a=a_out, b=b_out)


def merge_slices(adapter: HostAdapter, plan: TensorParallelPlan, rank: int) -> HostAdapter:
    """dLoRA merged mode on one rank: A and B whose s·B·A is this rank's slice of the whole delta, in
    the shape of its weight shard: column-parallel W keeps out rows slice i, so B's rows slice i with A
    whole; row-parallel W keeps in columns slice i, so A's columns slice i with B whole (the partial
    sums' all-reduce then adds the delta once). Nothing is padded: the rank stays r."""
    n = plan.world_size
    a_out: list[dict[str, torch.Tensor]] = []
    b_out: list[dict[str, torch.Tensor]] = []
    for a_layer, b_layer in zip(adapter.a, adapter.b):
        a_out.append({m: a if m in COLUMN_PARALLEL else _slice(a, 1, rank, n) for m, a in a_layer.items()})
        b_out.append({m: _slice(b, 0, rank, n) if m in COLUMN_PARALLEL else b for m, b in b_layer.items()})
    return HostAdapter(name=adapter.name, path=adapter.path, spec=adapter.spec, a=a_out, b=b_out)
