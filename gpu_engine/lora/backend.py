"""The LoRA backend contract and the factory that picks one by name.

A backend adds `s·(x A^T) B^T` into a projection's output for each adapter
segment of the step, reading A and B^T rows from one layer of the unified pool.
"""
from __future__ import annotations

from typing import Protocol

import torch

from loraplex.gpu_engine.lora.torch_backend import LoraGroup, TorchLoraBackend

LORA_BACKENDS = ("torch", "triton")


class LoraBackend(Protocol):
    def apply(self, out: torch.Tensor, x: torch.Tensor, pool_layer: torch.Tensor, module: str,
              groups: list[LoraGroup]) -> None:
        """out: [tokens, out_features] updated in place; x: [tokens, in_features]; pool_layer: flat layer."""


def make_lora_backend(name: str) -> LoraBackend:
    if name == "torch":
        return TorchLoraBackend()
    if name == "triton":
        from loraplex.gpu_engine.lora.triton_backend import TritonLoraBackend  # raises when Triton cannot run here

        return TritonLoraBackend()
    raise ValueError(f"lora_backend must be one of {LORA_BACKENDS}, got {name!r}")
