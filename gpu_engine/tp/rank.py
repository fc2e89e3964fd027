"""One rank of a tensor-parallel engine: its weight shard, its pool (its KV heads
and its adapter shards, in pages whose indices mean the same on every rank) and
its model. An engine of N ranks is N of these, each in its own process, driven
by the same step (see docs/architecture.md, "Tensor parallelism").
"""
from __future__ import annotations

import torch

from loraplex.contracts.geometry import AdapterLayout, PageGeometry
from loraplex.contracts.tensor_parallel import TensorParallelPlan
from loraplex.gpu_engine.lora.peft_adapter import HostAdapter
from loraplex.gpu_engine.lora.torch_backend import ResidentLora, place_adapter
from loraplex.gpu_engine.model.batch import ForwardBatch
from loraplex.gpu_engine.model.config import ModelConfig
from loraplex.gpu_engine.model.weights import ModelWeights
from loraplex.gpu_engine.pool import UnifiedPool
from loraplex.gpu_engine.tp.comm import TpComm
from loraplex.gpu_engine.tp.model import TpLlamaModel
from loraplex.gpu_engine.tp.partition import shard_adapter, shard_weights


class TpRank:
    def __init__(self, cfg: ModelConfig, weights: ModelWeights, comm: TpComm, num_pages: int, *,
                 page_tokens: int | None = None, device: torch.device = torch.device("cpu"),
                 dtype: torch.dtype = torch.float32) -> None:
        """weights: the whole model (sliced here; the full tensors can be dropped afterwards)."""
        self.plan = TensorParallelPlan.for_model(cfg, comm.world_size)
        self.comm = comm
        self.geometry: PageGeometry = self.plan.geometry(page_tokens)
        self.pool = UnifiedPool(cfg.num_layers, num_pages, self.geometry, device=device, dtype=dtype)
        self.model = TpLlamaModel(cfg, shard_weights(weights, self.plan, comm.rank), self.plan, comm)
        self.resident: dict[str, ResidentLora] = {}

    def layout(self, adapter: HostAdapter) -> AdapterLayout:
        return self.plan.adapter_layout(self.geometry, adapter.spec.targets, adapter.spec.rank)

    def place(self, adapter: HostAdapter, pages: list[int]) -> ResidentLora:
        """Copy this rank's shard of `adapter` into `pages` (the same page indices on every rank)."""
        shard = shard_adapter(adapter, self.plan, self.comm.rank)
        resident = place_adapter(self.pool, shard, self.layout(adapter), pages)
        self.resident[adapter.name] = resident
        return resident

    def forward(self, batch: ForwardBatch) -> torch.Tensor | None:
        """Logits [S, vocab] on rank 0, None elsewhere."""
        return self.model.forward(batch, self.pool)
