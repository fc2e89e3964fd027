"""How the executor's model is split over devices: the one place the executor asks
which model runs and what of an adapter goes into the pool or into merged weights.
Its `plan` (loraplex/contracts/tensor_parallel.py, one rank for one device) says what
the pool pages look like, as the cache manager computes it too. WholeModel is one
device (the model as loaded); gpu_engine/tp/shard.py's TpShard is one rank of a
tensor-parallel engine. The executor runs the same code over either."""
from __future__ import annotations

from typing import Protocol

import torch

from loraplex.contracts.tensor_parallel import TensorParallelPlan
from loraplex.gpu_engine.lora.backend import make_lora_backend
from loraplex.gpu_engine.lora.peft_adapter import HostAdapter
from loraplex.gpu_engine.model.config import ModelConfig
from loraplex.gpu_engine.model.cpu_gemm import CpuGemm
from loraplex.gpu_engine.model.llama import LlamaModel
from loraplex.gpu_engine.model.weights import ModelWeights, Selector
from loraplex.gpu_engine.tp.cpu_assist import AssistRow


class ModelSplit(Protocol):
    plan: TensorParallelPlan
    world_size: int
    rank: int
    samples: bool

    def shard_weights(self, weights: ModelWeights) -> ModelWeights: ...
    def weight_selector(self) -> Selector | None: ...
    def build_model(self, weights: ModelWeights, lora_backend: str, *,
                    packed_weights: bool = False) -> LlamaModel: ...
    def pool_copy(self, adapter: HostAdapter) -> HostAdapter: ...
    def merge_copy(self, adapter: HostAdapter) -> HostAdapter: ...
    def assist_step(self, inner, rows: list[AssistRow]) -> object: ...


class WholeModel:
    """One device holds every weight and every adapter whole."""

    world_size = 1
    rank = 0
    samples = True  # this process samples (and replies); a TP rank other than 0 does not

    def __init__(self, cfg: ModelConfig) -> None:
        self.cfg = cfg
        self.plan = TensorParallelPlan.for_model(cfg, 1)  # one rank: plan_adapter_layout's pages

    def shard_weights(self, weights: ModelWeights) -> ModelWeights:
        return weights

    def weight_selector(self) -> Selector | None:
        """What load_weights keeps of each checkpoint tensor: all of it."""
        return None

    def build_model(self, weights: ModelWeights, lora_backend: str, *, packed_weights: bool = False) -> LlamaModel:
        """weights: what shard_weights returned, on the device; packed_weights: float32 CPU projections
        through oneDNN-packed copies (model/cpu_gemm.py)."""
        cfg = self.cfg
        attention = None
        if lora_backend == "triton":  # the Triton build runs paged attention through its kernels too
            from loraplex.gpu_engine.model.attention_triton import TritonPagedAttention

            attention = TritonPagedAttention.for_config(cfg)
        return LlamaModel(cfg, weights, make_lora_backend(lora_backend), attention=attention,
                          gemm=CpuGemm(enabled=packed_weights))

    def pool_copy(self, adapter: HostAdapter) -> HostAdapter:
        """What of `adapter` the pool pages hold."""
        return adapter

    def merge_copy(self, adapter: HostAdapter) -> HostAdapter:
        """The A and B whose s·B·A has this process's weight shapes (dLoRA merged mode)."""
        return adapter

    def assist_step(self, inner, rows: list[AssistRow]) -> object:
        """What the model's batch.cpu is for a step with CPU-assisted `rows`: the CpuAssistStepRun itself."""
        if inner is None:
            raise ValueError("the plan assigns rows to CPU workers but no CPU assist is attached to this engine")
        return inner


def weights_device(split: ModelSplit, device: torch.device) -> torch.device:
    """Where whole weights are made before shard_weights: the device itself, or the host when they
    are sliced first (a rank never holds the whole model on its device)."""
    return device if split.world_size == 1 else torch.device("cpu")
