"""Random PEFT LoRA adapters for a random (or real) base config of any served family.

Owns the adapter_config.json fields and lora_A/lora_B tensor names and scales
of a demo adapter. Targets are the engine's module names (ModelConfig.module_shapes:
qkv_proj for a fused family, ...); the files name them as the family does (GPT-2's
c_attn, Phi's dense, ...), where PEFT would. B is never zero: the delta is sized to
a fixed fraction of the base projection's output so different adapters decode differently.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

# Per-element rms of s·(x Aᵀ) Bᵀ relative to the base output x Wᵀ (whose rms
# equals rms(x) under the checkpoint's 1/sqrt(in) weight scale): visible, not dominant.
LORA_DELTA_RATIO = 0.3

TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")  # Llama's


def lora_scaling(rank: int, alpha: float, use_rslora: bool) -> float:
    """PEFT's scaling factor s applied to (x Aᵀ) Bᵀ."""
    return alpha / math.sqrt(rank) if use_rslora else alpha / rank


def write_random_adapter(
    dest: Path,
    model_config: dict[str, Any],
    *,
    rank: int,
    alpha: float,
    target_modules: list[str],
    seed: int,
    use_rslora: bool = False,
    extra_config: dict[str, Any] | None = None,
) -> None:
    """Write adapter_config.json and adapter_model.safetensors for a random LoRA."""
    from loraplex.gpu_engine.model.config import ModelConfig

    if rank < 1:
        raise ValueError(f"rank must be >= 1, got {rank}")
    if alpha <= 0:
        raise ValueError(f"alpha must be > 0, got {alpha}")
    cfg = ModelConfig.from_hf(model_config)
    known = tuple(cfg.module_shapes())
    unknown = sorted(set(target_modules) - set(known))
    if unknown or not target_modules:
        raise ValueError(f"target_modules must be a non-empty subset of {known}, got {target_modules}")
    targets = sorted(set(target_modules))
    paths = cfg.module_paths()
    scaling = lora_scaling(rank, alpha, use_rslora)
    gen = torch.Generator(device="cpu").manual_seed(seed)

    tensors: dict[str, torch.Tensor] = {}
    for i in range(cfg.num_layers):
        for name in targets:
            in_f, out_f = cfg.module_shapes()[name]
            base = f"base_model.model.{cfg.layer_prefix}.{i}.{paths[name]}"
            # x Aᵀ has per-element std a·sqrt(in)·rms(x); with a = 1/sqrt(in) it is rms(x).
            # Then s·(x Aᵀ) Bᵀ has std s·b·sqrt(r)·rms(x), so b = ratio / (s·sqrt(r)).
            a_std = 1.0 / math.sqrt(in_f)
            b_std = LORA_DELTA_RATIO / (scaling * math.sqrt(rank))
            tensors[f"{base}.lora_A.weight"] = torch.randn((rank, in_f), generator=gen) * a_std  # [r, in]
            tensors[f"{base}.lora_B.weight"] = torch.randn((out_f, rank), generator=gen) * b_std  # [out, r]

    config: dict[str, Any] = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": alpha,
        "target_modules": sorted(_peft_names(paths, targets)),
        "lora_dropout": 0.0,
        "bias": "none",
        "use_rslora": use_rslora,
        "use_dora": False,
        "modules_to_save": None,
        "fan_in_fan_out": cfg.conv1d,  # PEFT's flag for GPT-2's Conv1D (the tensors are the same shapes)
        "init_lora_weights": True,
        "layers_to_transform": None,
        "layers_pattern": None,
        "rank_pattern": {},
        "alpha_pattern": {},
        "base_model_name_or_path": "loraplex-demo",
        "inference_mode": True,
    }
    config.update(extra_config or {})
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "adapter_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    save_file(tensors, str(dest / "adapter_model.safetensors"), metadata={"format": "pt"})


def _peft_names(paths: dict[str, str], targets: list[str]) -> list[str]:
    """PEFT target names: a module's own name, or its path in the layer where that name is shared
    (GPT-2's attn.c_proj and mlp.c_proj)."""
    leaves = [path.rsplit(".", 1)[-1] for path in paths.values()]
    names = []
    for name in targets:
        leaf = paths[name].rsplit(".", 1)[-1]
        names.append(leaf if leaves.count(leaf) == 1 else paths[name])
    return names
