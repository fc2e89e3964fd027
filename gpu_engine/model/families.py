"""Per-family facts of the HF architectures the engine serves: how a family's
config.json reads, and what its decoder layer does (norm kind, activation, q/k
norms, sandwich norms, parallel residual, learned positions, soft-caps), and
the families refused with the reason why.

Pure functions of the raw config dict (no torch, no transformers): config.py's
ModelConfig.from_hf calls normalize() then facts(). Defaults follow transformers
5.24's config classes where a real config.json may omit a field.
"""
from __future__ import annotations

from typing import Any

LLAMA_LIKE = ("llama", "mistral", "qwen2", "qwen3")
GEMMA = ("gemma", "gemma2", "gemma3_text")
SUPPORTED_MODEL_TYPES = LLAMA_LIKE + GEMMA + ("gemma3", "phi3", "phi", "gpt2")

REFUSED = {
    "qwen3_moe": "Qwen3-MoE (mixture-of-experts) models are not served; loraplex runs dense decoders only",
    "qwen3_5": "Qwen3.5 hybrid linear-attention (Gated DeltaNet) models are not served yet",
    "qwen3_5_text": "Qwen3.5 hybrid linear-attention (Gated DeltaNet) models are not served yet",
    "qwen3_next": "Qwen3-Next hybrid linear-attention models are not served yet",
    "nemotron_h": "Nemotron-H hybrid Mamba/attention models are not served yet",
}

# A Gemma 3 multimodal checkpoint: its language model's modules sit under this prefix (the live
# model's names, which PEFT adapters use), and the vision tower's and projector's under these (read
# past explicitly, never as unknown tensors). transformers 5.24 saves (and the Hub holds) the older
# key layout, renamed on load by GEMMA3_KEY_RENAMES.
GEMMA3_TEXT_PREFIX = "model.language_model"
GEMMA3_SKIPPED_PREFIXES = ("model.vision_tower.", "model.multi_modal_projector.", "vision_tower.",
                           "multi_modal_projector.")
GEMMA3_KEY_RENAMES = (("language_model.model.", "model.language_model."), ("language_model.lm_head.", "lm_head."))

_GELU_TANH = ("gelu_pytorch_tanh", "gelu_new", "gelu_fast", "gelu_python_tanh")


class FamilyError(ValueError):
    """Raised by this module; config.py re-raises it as UnsupportedModelError."""


def normalize(raw: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """(the decoder's config dict under common field names, its weights' prefix)."""
    model_type = raw.get("model_type")
    if model_type == "gemma3":
        text = raw.get("text_config")
        if not isinstance(text, dict):
            raise FamilyError("a gemma3 config needs a text_config dict (the language model's config)")
        text = dict(text)
        text.setdefault("model_type", "gemma3_text")
        if text["model_type"] != "gemma3_text":
            raise FamilyError(f"gemma3 text_config.model_type must be 'gemma3_text', got {text['model_type']!r}")
        text.setdefault("tie_word_embeddings", raw.get("tie_word_embeddings", True))
        for key in ("eos_token_id", "bos_token_id"):
            if key not in text and key in raw:
                text[key] = raw[key]
        return text, GEMMA3_TEXT_PREFIX
    if model_type == "gpt2":
        out = dict(raw)
        n_embd = raw.get("n_embd", 768)
        renames = {"hidden_size": n_embd, "num_hidden_layers": raw.get("n_layer", 12),
                   "num_attention_heads": raw.get("n_head", 12),
                   "intermediate_size": raw.get("n_inner") or (4 * n_embd if isinstance(n_embd, int) else None),
                   "max_position_embeddings": raw.get("n_positions", 1024),
                   "hidden_act": raw.get("activation_function", "gelu_new"),
                   "rms_norm_eps": raw.get("layer_norm_epsilon", 1e-5)}
        out.update(renames)
        out.setdefault("tie_word_embeddings", True)
        out.pop("head_dim", None)
        return out, "transformer"
    if model_type == "phi":
        out = dict(raw)
        out["rms_norm_eps"] = raw.get("layer_norm_eps", 1e-5)
        return out, "model"
    return raw, "model"


def _refuse_if(raw: dict[str, Any], key: str, bad, why: str) -> None:
    if key in raw and bad(raw[key]):
        raise FamilyError(f"unsupported field {key}={raw[key]!r}: {why}")


def _activation(raw: dict[str, Any], key: str, default: str) -> str:
    act = raw.get(key) or default
    if act == "silu":
        return "silu"
    if act in _GELU_TANH:
        return "gelu_tanh"
    raise FamilyError(f"unsupported {key}={act!r}: supported: silu, {', '.join(_GELU_TANH)}")


def layer_types(raw: dict[str, Any], model_type: str, num_layers: int) -> tuple[bool, ...] | None:
    """Per layer, True where it attends within the sliding window; None where every layer does
    whenever a window is set (Mistral, Phi-3). transformers 5.24's defaults when layer_types is absent."""
    types = raw.get("layer_types")
    if types is not None:
        if not isinstance(types, list) or len(types) != num_layers:
            raise FamilyError(f"layer_types must list one type per layer ({num_layers}), got {types!r}")
        bad = sorted(set(types) - {"sliding_attention", "full_attention"})
        if bad:
            raise FamilyError(f"unsupported layer_types {bad}: only sliding_attention and full_attention")
        return tuple(t == "sliding_attention" for t in types)
    if model_type in ("qwen2", "qwen3"):
        first = int(raw.get("max_window_layers", 28))
        return tuple(i >= first for i in range(num_layers))
    if model_type == "gemma2":
        return tuple(bool((i + 1) % 2) for i in range(num_layers))
    if model_type == "gemma3_text":
        pattern = int(raw.get("sliding_window_pattern", 6))
        return tuple(bool((i + 1) % pattern) for i in range(num_layers))
    return None


def sliding_window(raw: dict[str, Any], model_type: str) -> int | None:
    if model_type in ("qwen2", "qwen3"):
        if not raw.get("use_sliding_window"):
            return None
        window = raw.get("sliding_window", 4096)
    elif model_type in ("mistral", "phi3"):
        window = raw.get("sliding_window")
    elif model_type in ("gemma2", "gemma3_text"):
        window = raw.get("sliding_window", 4096)
    else:
        return None
    if window is None:
        return None
    if not isinstance(window, int) or isinstance(window, bool) or window <= 0:
        raise FamilyError(f"sliding_window must be a positive integer, got {window!r}")
    return window


def facts(raw: dict[str, Any], model_type: str, head_dim: int) -> dict[str, Any]:
    """ModelConfig's per-family fields for this (normalized) config."""
    f: dict[str, Any] = {}
    if model_type in LLAMA_LIKE:
        _refuse_if(raw, "hidden_act", lambda v: v not in (None, "silu"), "only hidden_act 'silu' is supported")
        f["qk_norm"] = model_type == "qwen3"
    elif model_type in GEMMA:
        if model_type == "gemma":  # Gemma 1 reads hidden_act; its legacy "gelu" means the tanh GeLU
            f["activation"] = "gelu_tanh" if raw.get("hidden_act") == "gelu" else \
                _activation(raw, "hidden_act", "gelu_pytorch_tanh")
        else:
            f["activation"] = _activation(raw, "hidden_activation", "gelu_pytorch_tanh")
        f.update(norm="rms1p", embed_scaled=True, tie_default=True)
        if model_type != "gemma":
            _refuse_if(raw, "use_bidirectional_attention", bool, "bidirectional attention is not a causal decoder")
            f["sandwich_norm"] = True
            f["query_scale"] = float(raw.get("query_pre_attn_scalar", 256)) ** -0.5
            default_attn_cap, default_final_cap = (50.0, 30.0) if model_type == "gemma2" else (None, None)
            cap = raw.get("attn_logit_softcapping", default_attn_cap)
            f["attn_softcap"] = None if cap is None else float(cap)
            final = raw.get("final_logit_softcapping", default_final_cap)
            f["final_softcap"] = None if final is None else float(final)
            f["qk_norm"] = model_type == "gemma3_text"
    elif model_type == "phi3":
        f["activation"] = _activation(raw, "hidden_act", "silu")
        f.update(fused_qkv=True, fused_gate_up=True)
    elif model_type == "phi":
        _refuse_if(raw, "qk_layernorm", bool, "Phi q/k LayerNorm is not supported")
        f.update(activation=_activation(raw, "hidden_act", "gelu_new"), norm="layer", gated_mlp=False,
                 parallel_residual=True, lm_head_bias=True, attn_bias=True, mlp_bias=True)
    elif model_type == "gpt2":
        _refuse_if(raw, "scale_attn_by_inverse_layer_idx", bool, "per-layer attention scaling is not supported")
        _refuse_if(raw, "reorder_and_upcast_attn", bool, "reorder_and_upcast_attn is not supported")
        _refuse_if(raw, "scale_attn_weights", lambda v: not v, "unscaled GPT-2 attention is not supported")
        _refuse_if(raw, "add_cross_attention", bool, "cross-attention is not a decoder-only model")
        f.update(activation=_activation(raw, "hidden_act", "gelu_new"), norm="layer", gated_mlp=False,
                 fused_qkv=True, learned_positions=True, rotary=False, attn_bias=True, mlp_bias=True)
    return f


def rope_params(raw: dict[str, Any], layer_type: str | None) -> dict[str, Any]:
    """The RoPE parameters of one layer type (Gemma 3 keys rope_parameters by layer type) merged
    with the legacy top-level fields; {} when unscaled."""
    params = raw.get("rope_scaling")
    if params is None:
        params = raw.get("rope_parameters")
    params = dict(params or {})
    if layer_type is None:
        return params
    if "full_attention" in params or "sliding_attention" in params:
        return dict(params.get(layer_type) or {})
    # a legacy flat rope_scaling scales the global layers only (transformers' Gemma 3 config)
    return params if layer_type == "full_attention" else {}
