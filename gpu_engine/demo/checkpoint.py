"""Random HuggingFace-format checkpoints for Llama, Mistral and Qwen2 configs (and, through
families.py, for every other family the engine serves).

Owns the tensor names, shapes and value scales of a freshly random base model
and the on-disk layout (single file or HF-style shards plus index). Values are
a pure function of the seed; this module never downloads or reads weights.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

# Target std of the logits at the last position: peaked enough that greedy
# argmaxes rarely sit on near-ties, not so peaked that every prompt collapses.
LOGIT_STD = 4.0

_SUPPORTED_TYPES = ("llama", "mistral", "qwen2")


def llama_config(**overrides: Any) -> dict[str, Any]:
    """A complete LlamaForCausalLM config.json dict (tiny by default)."""
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "hidden_size": 64,
        "intermediate_size": 176,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "vocab_size": 512,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "initializer_range": 0.02,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "pretraining_tp": 1,
        "tie_word_embeddings": False,
        "use_cache": True,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "float32",
    }
    config.update(overrides)
    return config


def mistral_config(**overrides: Any) -> dict[str, Any]:
    """A complete MistralForCausalLM config.json dict (no sliding window by default)."""
    config = llama_config(architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=None)
    # Mistral has no bias knobs; its attention and MLP are always bias-free.
    for key in ("attention_bias", "mlp_bias", "pretraining_tp"):
        del config[key]
    config.update(overrides)
    return config


def qwen2_config(**overrides: Any) -> dict[str, Any]:
    """A complete Qwen2ForCausalLM config.json dict (q/k/v biases are implied)."""
    config = llama_config(
        architectures=["Qwen2ForCausalLM"],
        model_type="qwen2",
        use_sliding_window=False,
        sliding_window=None,
        max_window_layers=2,
    )
    for key in ("attention_bias", "mlp_bias", "pretraining_tp", "head_dim"):
        del config[key]
    config.update(overrides)
    return config


def head_dim_of(config: dict[str, Any]) -> int:
    """The per-head width: explicit `head_dim`, else hidden_size / num_attention_heads."""
    head_dim = config.get("head_dim")
    if head_dim is None:
        return int(config["hidden_size"]) // int(config["num_attention_heads"])
    return int(head_dim)


def projection_shapes(config: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """(out_features, in_features) of every per-layer linear, keyed by module name."""
    hidden = int(config["hidden_size"])
    inter = int(config["intermediate_size"])
    head_dim = head_dim_of(config)
    q_width = int(config["num_attention_heads"]) * head_dim
    kv_width = int(config.get("num_key_value_heads") or config["num_attention_heads"]) * head_dim
    return {
        "q_proj": (q_width, hidden),
        "k_proj": (kv_width, hidden),
        "v_proj": (kv_width, hidden),
        "o_proj": (hidden, q_width),
        "gate_proj": (inter, hidden),
        "up_proj": (inter, hidden),
        "down_proj": (hidden, inter),
    }


def module_prefix(name: str) -> str:
    """The submodule a projection lives under inside a decoder layer."""
    return "mlp" if name in ("gate_proj", "up_proj", "down_proj") else "self_attn"


def _biases(config: dict[str, Any]) -> set[str]:
    """Projection names that carry a bias under this config."""
    model_type = config.get("model_type")
    if model_type == "qwen2":
        return {"q_proj", "k_proj", "v_proj"}
    if model_type == "mistral":
        return set()
    out: set[str] = set()
    if config.get("attention_bias"):
        out |= {"q_proj", "k_proj", "v_proj", "o_proj"}
    if config.get("mlp_bias"):
        out |= {"gate_proj", "up_proj", "down_proj"}
    return out


def random_state_dict(config: dict[str, Any], *, seed: int,
                      dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """All tensors of a random checkpoint, in a fixed generation order."""
    model_type = config.get("model_type")
    if model_type not in _SUPPORTED_TYPES:
        from .families import family_state_dict

        return family_state_dict(config, seed=seed, dtype=dtype)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    hidden = int(config["hidden_size"])
    vocab = int(config["vocab_size"])
    shapes = projection_shapes(config)
    biased = _biases(config)

    def normal(shape: tuple[int, ...], std: float, mean: float = 0.0) -> torch.Tensor:
        t = torch.randn(shape, generator=gen, dtype=torch.float32) * std + mean
        return t.to(dtype)

    tensors: dict[str, torch.Tensor] = {"model.embed_tokens.weight": normal((vocab, hidden), 1.0)}
    for i in range(int(config["num_hidden_layers"])):
        layer = f"model.layers.{i}"
        tensors[f"{layer}.input_layernorm.weight"] = normal((hidden,), 0.1, 1.0)
        tensors[f"{layer}.post_attention_layernorm.weight"] = normal((hidden,), 0.1, 1.0)
        for name, (out_f, in_f) in shapes.items():
            base = f"{layer}.{module_prefix(name)}.{name}"
            # std 1/sqrt(in) keeps the per-element output rms equal to the input rms,
            # so the residual stream neither vanishes nor explodes across layers.
            tensors[f"{base}.weight"] = normal((out_f, in_f), 1.0 / math.sqrt(in_f))
            if name in biased:
                tensors[f"{base}.bias"] = normal((out_f,), 0.1)
    tensors["model.norm.weight"] = normal((hidden,), 0.1, 1.0)
    if not config.get("tie_word_embeddings", False):
        # The final norm leaves rms ~1 per element, so logit std ~ std * sqrt(hidden).
        tensors["lm_head.weight"] = normal((vocab, hidden), LOGIT_STD / math.sqrt(hidden))
    return tensors


def _split_shards(names: list[str], tensors: dict[str, torch.Tensor], num_shards: int) -> list[list[str]]:
    """Contiguous groups of names with roughly equal byte counts, none empty."""
    sizes = [tensors[n].numel() * tensors[n].element_size() for n in names]
    target = sum(sizes) / num_shards
    shards: list[list[str]] = [[]]
    filled = 0
    for idx, (name, size) in enumerate(zip(names, sizes)):
        remaining_names = len(names) - idx
        remaining_shards = num_shards - len(shards)
        # Open a new shard when this one is full, or when every later name is needed
        # to keep the remaining shards non-empty.
        if shards[-1] and remaining_shards > 0 and (filled >= target * len(shards)
                                                    or remaining_names <= remaining_shards):
            shards.append([])
        shards[-1].append(name)
        filled += size
    return shards


def write_random_checkpoint(
    dest: Path,
    config: dict[str, Any],
    *,
    seed: int,
    num_shards: int = 1,
    dtype: torch.dtype = torch.float32,
) -> None:
    """Write config.json and random safetensors weights for `config` into `dest`."""
    tensors = random_state_dict(config, seed=seed, dtype=dtype)
    names = list(tensors)
    if not 1 <= num_shards <= len(names):
        raise ValueError(f"num_shards must be in [1, {len(names)}], got {num_shards}")
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    metadata = {"format": "pt"}
    if num_shards == 1:
        save_file(tensors, str(dest / "model.safetensors"), metadata=metadata)
        return
    weight_map: dict[str, str] = {}
    total_size = 0
    for k, group in enumerate(_split_shards(names, tensors, num_shards), start=1):
        filename = f"model-{k:05d}-of-{num_shards:05d}.safetensors"
        save_file({n: tensors[n] for n in group}, str(dest / filename), metadata=metadata)
        for n in group:
            weight_map[n] = filename
            total_size += tensors[n].numel() * tensors[n].element_size()
    index = {"metadata": {"total_size": total_size}, "weight_map": weight_map}
    (dest / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
