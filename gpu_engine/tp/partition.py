"""Slice a model's weights and an adapter's A/B into one rank's shard, as the
tensor-parallel plan (loraplex.contracts.tensor_parallel) defines them.

Every rank keeps 1/N of each matrix: nothing of an adapter is replicated. The
shards are copies (contiguous), so a rank can drop the full tensors afterwards.
The base model's rule is rank_slice alone: shard_weights applies it to whole
tensors in memory, rank_selector to safetensors slices as a checkpoint is read.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from loraplex.contracts.tensor_parallel import COLUMN_PARALLEL, ROW_PARALLEL, TensorParallelPlan
from loraplex.gpu_engine.lora.peft_adapter import HostAdapter
from loraplex.gpu_engine.model.config import ModelConfig, UnsupportedModelError
from loraplex.gpu_engine.model.weights import LayerWeights, ModelWeights, Selector


def _slice(t: torch.Tensor, dim: int, rank: int, parts: int) -> torch.Tensor:
    size = t.shape[dim] // parts
    return t.narrow(dim, rank * size, size).contiguous()


def rank_config(cfg: ModelConfig, plan: TensorParallelPlan) -> ModelConfig:
    """The model as one rank sees it: its heads, its slice of the MLP and of the vocabulary."""
    blocker = cfg.tp_blocker()
    if blocker is not None and plan.world_size > 1:
        raise UnsupportedModelError(blocker)
    return dataclasses.replace(cfg, num_heads=plan.heads, num_kv_heads=plan.kv_heads,
                               intermediate_size=cfg.intermediate_size // plan.world_size,
                               vocab_size=plan.vocab_shard)


@dataclass(frozen=True, slots=True)
class RankSlice:
    """Which part of a base-model tensor one rank holds: [start, stop) along `dim` of the full
    tensor, then zeros up to `size` along it (the vocabulary's padding; size == stop - start elsewhere).
    A tensor kept whole is dim 0, [0, len)."""

    dim: int
    start: int
    stop: int
    size: int

    def take(self, full) -> torch.Tensor:
        """This part of `full` (a tensor, or a safetensors slice: only this part is read from the
        file), padded with zeros to `size` along `dim`, contiguous."""
        part = full[(slice(None),) * self.dim + (slice(self.start, self.stop),)]
        missing = self.size - part.shape[self.dim]
        if missing:
            part = F.pad(part, (0, 0) * (part.dim() - 1 - self.dim) + (0, missing))
        return part.contiguous()


@dataclass(frozen=True, slots=True)
class FusedSlice:
    """A fused column-parallel tensor's part for one rank: its slice of each fused projection along
    dim 0 (Phi-3's qkv_proj: its q heads, then its k and v heads), concatenated."""

    parts: tuple[RankSlice, ...]

    def take(self, full) -> torch.Tensor:
        return torch.cat([p.take(full) for p in self.parts], dim=0)


def _fused(parts: tuple[int, ...], rank: int, n: int) -> FusedSlice:
    slices, offset = [], 0
    for size in parts:
        step = size // n
        slices.append(RankSlice(0, offset + rank * step, offset + (rank + 1) * step, step))
        offset += size
    return FusedSlice(tuple(slices))


def rank_slice(module: str, param: str, shape: tuple[int, ...], plan: TensorParallelPlan,
               rank: int) -> RankSlice | FusedSlice:
    """The one split rule of the base model (Megatron-LM), for the tensor `param` ("weight" or "bias")
    of `module` (the engine's name: a projection, "embed_tokens", "lm_head", "norm" or another norm)
    of full `shape`: column-parallel projections and their biases along out (dim 0), row-parallel
    along in (dim 1) with their biases whole (added once, after the all-reduce), embedding and LM head
    by vocabulary rows padded to a multiple of N, anything else whole."""
    if module in ("embed_tokens", "lm_head"):
        size = plan.vocab_shard
        start = rank * size
        return RankSlice(0, min(start, shape[0]), min(start + size, shape[0]), size)
    if module in COLUMN_PARALLEL and len(plan.fused_parts(module)) > 1:
        return _fused(plan.fused_parts(module), rank, plan.world_size)
    dim = 0 if module in COLUMN_PARALLEL else 1 if module in ROW_PARALLEL and param == "weight" else None
    if dim is None:
        return RankSlice(0, 0, shape[0], shape[0])
    size = shape[dim] // plan.world_size
    return RankSlice(dim, rank * size, (rank + 1) * size, size)


def _out_rows(b: torch.Tensor, module: str, plan: TensorParallelPlan, rank: int) -> torch.Tensor:
    """This rank's rows of a column-parallel module's out-feature axis (of B, like its weight)."""
    parts = plan.fused_parts(module)
    if len(parts) > 1:
        return _fused(parts, rank, plan.world_size).take(b)
    return _slice(b, 0, rank, plan.world_size)


def _take(t: torch.Tensor, module: str, param: str, plan: TensorParallelPlan, rank: int) -> torch.Tensor:
    return rank_slice(module, param, tuple(t.shape), plan, rank).take(t)


def shard_weights(weights: ModelWeights, plan: TensorParallelPlan, rank: int) -> ModelWeights:
    """One rank's shard of whole weights (rank_slice's rule), for weights made whole in memory (random
    weights, tests); a checkpoint is read sliced instead (rank_selector)."""
    layers = []
    for layer in weights.layers:
        layers.append(LayerWeights(
            input_norm=_take(layer.input_norm, "input_layernorm", "weight", plan, rank),
            post_norm=None if layer.post_norm is None else _take(layer.post_norm, "post_attention_layernorm",
                                                                 "weight", plan, rank),
            proj={name: _take(w, name, "weight", plan, rank) for name, w in layer.proj.items()},
            bias={name: _take(b, name, "bias", plan, rank) for name, b in layer.bias.items()},
            # q/k norms are per head (the same weights for every head) and the others span hidden: whole
            norms={name: _take(w, name, "weight", plan, rank) for name, w in layer.norms.items()},
            norm_bias={name: _take(b, name, "bias", plan, rank) for name, b in layer.norm_bias.items()}))
    embed = _take(weights.embed, "embed_tokens", "weight", plan, rank)
    lm_head = embed if weights.lm_head is weights.embed else _take(weights.lm_head, "lm_head", "weight", plan, rank)
    return ModelWeights(embed=embed, layers=layers, norm=_take(weights.norm, "norm", "weight", plan, rank),
                        lm_head=lm_head, norm_bias=weights.norm_bias,
                        lm_head_bias=None if weights.lm_head_bias is None
                        else _take(weights.lm_head_bias, "lm_head", "bias", plan, rank))


def rank_selector(plan: TensorParallelPlan, rank: int) -> Selector:
    """load_weights' `select` that reads only this rank's part of every tensor from the safetensors
    files (get_slice: the other ranks' bytes are never copied out of the mapped file)."""
    def select(module: str, param: str, part) -> torch.Tensor:
        return rank_slice(module, param, tuple(part.get_shape()), plan, rank).take(part)

    return select


def shard_lora(module: str, a: torch.Tensor, b: torch.Tensor, plan: TensorParallelPlan,
               rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One rank's (A [rows, width], B [out/N, rows]) of a module's A [r, in], B [out, r] (S-LoRA §6.1)."""
    n = plan.world_size
    if module in COLUMN_PARALLEL:
        r_pad = plan.lora_rank_shard(a.shape[0]) * n
        a = F.pad(a, (0, 0, 0, r_pad - a.shape[0]))  # zero rows: x·A of the padding is zero
        b = F.pad(b, (0, r_pad - b.shape[1]))
        return _slice(a, 0, rank, n), _out_rows(b, module, plan, rank)
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
        b_out.append({m: _out_rows(b, m, plan, rank) if m in COLUMN_PARALLEL else b for m, b in b_layer.items()})
    return HostAdapter(name=adapter.name, path=adapter.path, spec=adapter.spec, a=a_out, b=b_out)
