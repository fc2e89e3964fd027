"""One tensor-parallel rank's Llama forward: the single-device forward
(gpu_engine/model/llama.py) over this rank's heads, weight shards and pool, with
the collectives where Megatron-LM and S-LoRA put them:

- embedding: vocabulary rows of this rank, all-reduced (tag "embed");
- q/k/v/gate/up: column-parallel, no base traffic; LoRA x·A all-gathered ("lora"),
  one collective for q/k/v and one for gate/up;
- o/down: row-parallel; LoRA partial x·A all-reduced ("lora"), its B output added
  into this rank's columns of the partial sum before the base all-reduce ("base");
- LM head: vocabulary-parallel logits gathered to rank 0, which samples.
CPU-assisted rows (batch.cpu) go through gpu_engine/tp/cpu_assist.py's TpCpuAssist.

Collectives run in the same order on every rank because every rank runs the same
step: which segments target which module is part of the step, not of the rank.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from loraplex.contracts.tensor_parallel import COLUMN_PARALLEL, TensorParallelPlan
from loraplex.gpu_engine.lora.torch_backend import LoraGroup, TorchLoraBackend
from loraplex.gpu_engine.model.config import ModelConfig
from loraplex.gpu_engine.model.llama import LlamaModel
from loraplex.gpu_engine.model.weights import LayerWeights, ModelWeights
from loraplex.gpu_engine.tp.comm import TpComm
from loraplex.gpu_engine.tp.lora import expand_gathered, expand_reduced, shrink, targeting
from loraplex.gpu_engine.tp.partition import rank_config

# The column-parallel projections that share an input, keyed by the first one the forward runs:
# their x·A shards travel in one all-gather (an MLP without a gate: up_proj alone).
SITES = {"q_proj": ("q_proj", "k_proj", "v_proj"), "gate_proj": ("gate_proj", "up_proj")}
UNGATED_SITES = {"q_proj": ("q_proj", "k_proj", "v_proj"), "up_proj": ("up_proj",)}


class TpLlamaModel(LlamaModel):
    def __init__(self, cfg: ModelConfig, weights: ModelWeights, plan: TensorParallelPlan, comm: TpComm) -> None:
        """cfg: the whole model's config; weights: this rank's shard (partition.shard_weights)."""
        if comm.world_size != plan.world_size:
            raise ValueError(f"plan for {plan.world_size} ranks, group of {comm.world_size}")
        super().__init__(rank_config(cfg, plan), weights, TorchLoraBackend())
        self.plan = plan
        self.comm = comm
        self.full_vocab = cfg.vocab_size
        self.vocab_start = comm.rank * plan.vocab_shard
        out_slice = cfg.hidden_size // plan.world_size
        self.out_cols = slice(comm.rank * out_slice, (comm.rank + 1) * out_slice)  # of a row-parallel output
        self._gathered: dict[str, torch.Tensor] = {}  # x·A gathered for the projections still to run
        self.sites = SITES if cfg.gated_mlp else UNGATED_SITES
        if cfg.fused_qkv or cfg.fused_gate_up:  # a fused module is the only projection of its input
            self.sites = {m: (m,) for m in cfg.module_shapes() if m in COLUMN_PARALLEL}

    def _embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        local = token_ids - self.vocab_start
        inside = (local >= 0) & (local < self.plan.vocab_shard)
        h = F.embedding(local.clamp(0, self.plan.vocab_shard - 1), self.w.embed)
        h = h * inside[:, None].to(h.dtype)
        return self.comm.all_reduce(h, "embed")

    def _logits(self, last: torch.Tensor) -> torch.Tensor | None:
        # gathered in the model's dtype (half the bytes of float32 under bf16), widened afterwards: the same values
        # the bias is this rank's vocabulary slice too (zeros on the padding, dropped below)
        logits = self.comm.gather_last(F.linear(last, self.w.lm_head, self.w.lm_head_bias), "lm_head")
        return None if logits is None else logits[:, : self.full_vocab].float()

    def _gather_site(self, modules: tuple[str, ...], x: torch.Tensor, flat: torch.Tensor,
                     groups: list[LoraGroup]) -> None:
        """One all-gather for every column-parallel module reading `x` (q/k/v, gate/up): each module's
        x·A shard flattened into one buffer; the parts wait in _gathered for their projection."""
        self._gathered = {}
        parts = [(m, shrink(x, flat, m, lora)) for m in modules if (lora := targeting(groups, m))]
        if not parts:
            return
        n = self.plan.world_size
        full = self.comm.all_gather_last(torch.cat([z.reshape(-1) for _, z in parts]), "lora").view(n, -1)
        offset = 0
        for m, z in parts:
            tokens, width = z.shape
            part = full[:, offset: offset + tokens * width].reshape(n, tokens, width)
            self._gathered[m] = part.permute(1, 0, 2).reshape(tokens, n * width)  # rank j's columns at j·width
            offset += tokens * width

    def _proj(self, layer: LayerWeights, name: str, x: torch.Tensor, flat: torch.Tensor,
              groups: list[LoraGroup]) -> torch.Tensor:
        lora = targeting(groups, name)
        if name in COLUMN_PARALLEL:
            out = F.linear(x, layer.proj[name], layer.bias.get(name))  # [T, out/N]
            if name in self.sites:
                self._gather_site(self.sites[name], x, flat, groups)
            if lora:
                gathered = self._gathered.pop(name, None)
                if gathered is None:
                    raise RuntimeError(f"{name} ran before the first projection of its input ({self._gathered})")
                expand_gathered(out, gathered, flat, name, lora, self.plan.world_size)
            return out
        out = F.linear(x, layer.proj[name])  # [T, out] partial sum over this rank's in-features
        if lora:
            reduced = self.comm.all_reduce(shrink(x, flat, name, lora), "lora")
            expand_reduced(out[:, self.out_cols], reduced, flat, name, lora)
        self.comm.all_reduce(out, "base")  # also gathers every rank's LoRA output columns
        bias = layer.bias.get(name)
        return out if bias is None else out + bias
