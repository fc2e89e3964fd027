"""config.json dicts of tiny random models of every served family, in the field
names each family's own HF config class writes (so transformers loads them too),
and the random checkpoint of any family, its tensors named and shaped by the
engine's own ModelConfig (weights.expected_shapes), so the demo and the engine
can never disagree on a name.

Owns the value scales of a non-Llama random checkpoint: projections std
1/sqrt(fan_in), norms near neutral, and a tied embedding kept small beside the
layers' outputs with the final norm's gain making up (else the last input token
dominates the residual and greedy decoding repeats it).
"""
from __future__ import annotations

import math
from typing import Any

import torch

from loraplex.contracts.demo import DEMO_FAMILIES

from .checkpoint import LOGIT_STD, llama_config

_COMMON = dict(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, vocab_size=512, max_position_embeddings=4096, bos_token_id=1,
               eos_token_id=2, torch_dtype="float32", initializer_range=0.02, use_cache=True)


def family_config(family: str, **overrides: Any) -> dict[str, Any]:
    """A complete config.json dict of `family` (tiny by default; overrides use the family's own
    field names, except hidden_size / num_hidden_layers / ... which map to GPT-2's n_* fields)."""
    if family == "llama":
        return llama_config(**overrides)
    base = {**_COMMON, **overrides}
    if family == "qwen3":
        cfg = dict(base, model_type="qwen3", architectures=["Qwen3ForCausalLM"], hidden_act="silu",
                   head_dim=base.get("head_dim", 16), rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=False,
                   attention_bias=False, use_sliding_window=False, sliding_window=None, max_window_layers=28)
    elif family in ("gemma", "gemma2", "gemma3_text"):
        cfg = dict(base, model_type=family, hidden_activation="gelu_pytorch_tanh", hidden_act="gelu_pytorch_tanh",
                   head_dim=base.get("head_dim", 16),
                   rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=True, attention_bias=False,
                   architectures=[{"gemma": "GemmaForCausalLM", "gemma2": "Gemma2ForCausalLM",
                                   "gemma3_text": "Gemma3ForCausalLM"}[family]])
        if family != "gemma":
            layers = cfg["num_hidden_layers"]
            cfg.setdefault("sliding_window", 32)
            cfg.setdefault("query_pre_attn_scalar", cfg["head_dim"])
            cfg.setdefault("layer_types", ["sliding_attention" if i % 2 == 0 else "full_attention"
                                           for i in range(layers)])
            cfg.setdefault("attn_logit_softcapping", 50.0 if family == "gemma2" else None)
            cfg.setdefault("final_logit_softcapping", 30.0 if family == "gemma2" else None)
        if family == "gemma3_text":
            cfg.setdefault("rope_parameters", {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                               "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})
            del cfg["rope_theta"]
    elif family == "phi3":
        cfg = dict(base, model_type="phi3", architectures=["Phi3ForCausalLM"], hidden_act="silu",
                   rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False, pad_token_id=0,
                   original_max_position_embeddings=base["max_position_embeddings"], sliding_window=None)
    elif family == "phi":
        cfg = dict(base, model_type="phi", architectures=["PhiForCausalLM"], hidden_act="gelu_new",
                   layer_norm_eps=1e-5, rope_theta=10000.0, partial_rotary_factor=0.5, qk_layernorm=False,
                   tie_word_embeddings=False)
    elif family == "gpt2":
        cfg = {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_embd": base["hidden_size"],
               "n_layer": base["num_hidden_layers"], "n_head": base["num_attention_heads"], "n_inner": None,
               "n_positions": min(base["max_position_embeddings"], 1024), "vocab_size": base["vocab_size"],
               "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5, "tie_word_embeddings": True,
               "bos_token_id": base["bos_token_id"], "eos_token_id": base["eos_token_id"], "torch_dtype": "float32",
               "scale_attn_weights": True, "use_cache": True}
    else:
        raise ValueError(f"unknown demo family {family!r}; one of {', '.join(FAMILIES)}")
    return cfg


FAMILIES = DEMO_FAMILIES


def family_state_dict(config: dict[str, Any], *, seed: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Every tensor of a random checkpoint of `config`'s family, named and shaped as the engine
    reads it (stored shapes: GPT-2's Conv1D weights [in, out])."""
    from loraplex.gpu_engine.model.config import ModelConfig
    from loraplex.gpu_engine.model.weights import expected_shapes

    cfg = ModelConfig.from_hf(config)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    h = cfg.hidden_size
    top = cfg.top_paths()
    tied = cfg.tie_word_embeddings
    embed_std = 0.3 / (math.sqrt(h) if cfg.embed_scaled else 1.0) if tied else 1.0
    final_gain = LOGIT_STD / (math.sqrt(h) * embed_std) if tied else 1.0
    one_plus = cfg.norm == "rms1p"  # (1 + w): neutral at 0

    def normal(shape: tuple[int, ...], std: float, mean: float = 0.0) -> torch.Tensor:
        return (torch.randn(shape, generator=gen, dtype=torch.float32) * std + mean).to(dtype)

    out: dict[str, torch.Tensor] = {}
    for key, shape in expected_shapes(cfg).items():
        module = key.rsplit(".", 1)[0]
        if module == top["embed"]:
            out[key] = normal(shape, embed_std)
        elif module == top.get("pos_embed"):
            out[key] = normal(shape, 0.3)
        elif module == top["lm_head"]:
            out[key] = normal(shape, LOGIT_STD / math.sqrt(h) if key.endswith("weight") else 0.1)
        elif len(shape) == 1 and key.endswith(".weight"):  # a norm
            gain = final_gain if module == top["norm"] else 1.0
            out[key] = normal(shape, 0.1, gain - 1.0 if one_plus else gain)
        elif len(shape) == 1:  # a bias
            out[key] = normal(shape, 0.1)
        else:
            fan_in = shape[0] if cfg.conv1d else shape[1]
            out[key] = normal(shape, 1.0 / math.sqrt(fan_in))
    return out
