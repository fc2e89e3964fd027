"""Load a HuggingFace Llama-family checkpoint (single or sharded safetensors)
into typed per-layer weight holders on the target device and dtype, or build
random weights of the config's shapes on the device (load format `dummy`, for
benchmarks at real model sizes without a checkpoint on disk).

Safetensors only: pickled checkpoints are refused, never unpickled. Every
tensor is checked against the config's shapes; unknown tensors are refused
rather than silently ignored. A `select` reads only part of every tensor out of
the files (a tensor-parallel rank's shard: gpu_engine/tp/partition.py's
rank_selector), after the same checks on the full shapes.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors import safe_open

from loraplex.gpu_engine.model.config import ModelConfig, UnsupportedModelError

_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)

# (checkpoint key, safetensors slice of the whole tensor) -> the part of it to keep
Selector = Callable[[str, Any], torch.Tensor]


@dataclass(slots=True)
class LayerWeights:
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    proj: dict[str, torch.Tensor]  # module name -> [out, in]
    bias: dict[str, torch.Tensor]  # module name -> [out], only where the checkpoint has one


@dataclass(slots=True)
class ModelWeights:
    embed: torch.Tensor  # [vocab, hidden]
    layers: list[LayerWeights]
    norm: torch.Tensor
    lm_head: torch.Tensor  # [vocab, hidden]; the embedding itself when tied

    def to(self, device: torch.device) -> ModelWeights:
        """The same weights on `device` (itself when already there); a tied LM head stays tied."""
        if self.embed.device == device:
            return self

        def move(t: torch.Tensor) -> torch.Tensor:
            return t.to(device)

        layers = [LayerWeights(input_norm=move(lw.input_norm), post_norm=move(lw.post_norm),
                               proj={n: move(w) for n, w in lw.proj.items()},
                               bias={n: move(b) for n, b in lw.bias.items()}) for lw in self.layers]
        embed = move(self.embed)
        return ModelWeights(embed=embed, layers=layers, norm=move(self.norm),
                            lm_head=embed if self.lm_head is self.embed else move(self.lm_head))


def checkpoint_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [model_dir / name for name in sorted(set(weight_map.values()))]
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    if any(model_dir.glob("*.bin")) or any(model_dir.glob("*.pt")):
        raise UnsupportedModelError(
            f"{model_dir} holds only pickle checkpoints (.bin/.pt); loraplex loads safetensors only"
        )
    raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {model_dir}")


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, cfg.hidden_size),
                                          "model.norm.weight": (cfg.hidden_size,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, cfg.hidden_size)
    for i in range(cfg.num_layers):
        p = f"{cfg.layer_prefix}.{i}."
        shapes[p + "input_layernorm.weight"] = (cfg.hidden_size,)
        shapes[p + "post_attention_layernorm.weight"] = (cfg.hidden_size,)
        paths = cfg.module_paths()
        for name, (fan_in, fan_out) in cfg.module_shapes().items():
            shapes[p + paths[name] + ".weight"] = (fan_out, fan_in)
            if _has_bias(cfg, name):
                shapes[p + paths[name] + ".bias"] = (fan_out,)
    return shapes


def _has_bias(cfg: ModelConfig, name: str) -> bool:
    if name in ("q_proj", "k_proj", "v_proj"):
        return cfg.qkv_bias
    if name == "o_proj":
        return cfg.o_bias
    return cfg.mlp_bias


def load_weights(model_dir: str | Path, cfg: ModelConfig, *, device: torch.device,
                 dtype: torch.dtype, select: Selector | None = None) -> ModelWeights:
    """The checkpoint's weights on `device` in `dtype`: whole, or what `select` keeps of every tensor
    (read from the file as that part only; a tied LM head stays the selected embedding)."""
    model_dir = Path(model_dir)
    want = expected_shapes(cfg)
    got: dict[str, torch.Tensor] = {}
    for file in checkpoint_files(model_dir):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for key in f.keys():
                if key.endswith(_IGNORED_SUFFIXES) or (key == "lm_head.weight" and cfg.tie_word_embeddings):
                    continue
                if key not in want:
                    raise UnsupportedModelError(f"unexpected tensor {key!r} in {file.name} for this config")
                part = f.get_slice(key)  # lazy: nothing read yet
                shape = tuple(part.get_shape())
                if shape != want[key]:
                    raise UnsupportedModelError(f"tensor {key} has shape {shape}, expected {want[key]}")
                t = f.get_tensor(key) if select is None else select(key, part)
                got[key] = t.to(device=device, dtype=dtype)
    missing = sorted(set(want) - set(got))
    if missing:
        raise UnsupportedModelError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:3]}")
    layers = []
    paths = cfg.module_paths()
    for i in range(cfg.num_layers):
        p = f"{cfg.layer_prefix}.{i}."
        layers.append(LayerWeights(
            input_norm=got[p + "input_layernorm.weight"],
            post_norm=got[p + "post_attention_layernorm.weight"],
            proj={n: got[p + paths[n] + ".weight"] for n in cfg.module_shapes()},
            bias={n: got[p + paths[n] + ".bias"] for n in cfg.module_shapes() if _has_bias(cfg, n)},
        ))
    embed = got["model.embed_tokens.weight"]
    return ModelWeights(embed=embed, layers=layers, norm=got["model.norm.weight"],
                        lm_head=embed if cfg.tie_word_embeddings else got["lm_head.weight"])


def random_weights(cfg: ModelConfig, *, device: torch.device, dtype: torch.dtype, seed: int = 0) -> ModelWeights:
    """Random weights of `cfg`'s shapes made on `device` (nothing read from disk): projections scaled by
    fan_in^-0.5 so activations stay finite through every layer, norms of ones, biases small."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def rand(*shape: int, std: float) -> torch.Tensor:
        return (torch.randn(*shape, device=device, dtype=torch.float32, generator=gen) * std).to(dtype)

    def ones() -> torch.Tensor:
        return torch.ones(cfg.hidden_size, device=device, dtype=dtype)

    shapes = cfg.module_shapes()
    layers = [LayerWeights(input_norm=ones(), post_norm=ones(),
                           proj={n: rand(fo, fi, std=fi ** -0.5) for n, (fi, fo) in shapes.items()},
                           bias={n: rand(fo, std=0.02) for n, (fi, fo) in shapes.items() if _has_bias(cfg, n)})
              for _ in range(cfg.num_layers)]
    embed = rand(cfg.vocab_size, cfg.hidden_size, std=1.0)
    return ModelWeights(embed=embed, layers=layers, norm=ones(),
                        lm_head=embed if cfg.tie_word_embeddings else rand(cfg.vocab_size, cfg.hidden_size, std=0.02))
