"""The executor's split (gpu_engine/model_split.py) on one rank of a tensor-parallel
engine: pages of the plan's per-rank geometry, adapters in the plan's rank-independent
layout, the rank's weight shard run by TpLlamaModel, and only the rank's slice of an
adapter in its pool (S-LoRA) or merged into its weights (dLoRA)."""
from __future__ import annotations

from loraplex.contracts.tensor_parallel import TensorParallelPlan
from loraplex.gpu_engine.lora.peft_adapter import HostAdapter
from loraplex.gpu_engine.model.config import ModelConfig
from loraplex.gpu_engine.model.weights import ModelWeights, Selector
from loraplex.gpu_engine.tp.comm import TpComm
from loraplex.gpu_engine.tp.cpu_assist import AssistRow, TpCpuAssist
from loraplex.gpu_engine.tp.model import TpLlamaModel
from loraplex.gpu_engine.tp.partition import merge_slices, rank_selector, shard_adapter, shard_weights


class TpShard:
    def __init__(self, cfg: ModelConfig, comm: TpComm, *, assisted: bool = False) -> None:
        """assisted: the engine runs adapter_load_mode=cpu_assist (rank 0 owns the exchange)."""
        self.cfg = cfg
        self.comm = comm
        self.assisted = assisted
        self.plan = TensorParallelPlan.for_model(cfg, comm.world_size)  # ValueError: cannot split N ways
        self.world_size = comm.world_size
        self.rank = comm.rank
        self.samples = comm.rank == 0  # logits are gathered to rank 0, which samples

    def shard_weights(self, weights: ModelWeights) -> ModelWeights:
        """This rank's slice of whole weights (random weights: every rank makes the same whole model)."""
        return shard_weights(weights, self.plan, self.rank)

    def weight_selector(self) -> Selector:
        """load_weights reads only this rank's slice of each checkpoint tensor, never the whole model."""
        return rank_selector(self.plan, self.rank)

    def build_model(self, weights: ModelWeights, lora_backend: str, *,
                    packed_weights: bool = False) -> TpLlamaModel:
        """packed_weights is not taken up yet: a rank's projections run F.linear on its shard."""
        if lora_backend != "torch":  # EngineSpec refuses it first; this guards direct use
            raise ValueError(f"tensor parallelism runs the torch LoRA backend, not {lora_backend!r}")
        return TpLlamaModel(self.cfg, weights, self.plan, self.comm)

    def pool_copy(self, adapter: HostAdapter) -> HostAdapter:
        return shard_adapter(adapter, self.plan, self.rank)

    def merge_copy(self, adapter: HostAdapter) -> HostAdapter:
        return merge_slices(adapter, self.plan, self.rank)

    def assist_step(self, inner, rows: list[AssistRow]) -> TpCpuAssist:
        """Every rank wraps the step's CPU rows; only rank 0 has the CpuAssistStepRun (`inner`). A plan
        with CPU rows for an engine without assist is refused on every rank alike, before any collective."""
        if not self.assisted or (self.rank == 0 and inner is None):
            raise ValueError("the plan assigns rows to CPU workers but no CPU assist is attached to this engine")
        return TpCpuAssist(self.comm, inner, rows, {m: self.plan.fused_parts(m) for m in self.cfg.module_shapes()})
