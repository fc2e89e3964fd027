"""Model configuration: parse and validate a HuggingFace config.json for the
architectures the engine runs (Llama, Mistral, Qwen2).

Owns the one place where HF field names are read. Anything the executor would
silently get wrong is refused here with an error naming the field.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


class UnsupportedModelError(ValueError):
    """The checkpoint uses a feature the engine does not implement."""


@dataclass(frozen=True, slots=True)
class RopeScaling:
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True, slots=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    sliding_window: int | None
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    # Per layer: True where the layer attends within sliding_window only; () = every layer does
    # when sliding_window is set (Mistral). Gemma 2/3 interleave sliding and global layers.
    sliding_layers: tuple[bool, ...] = ()
    query_scale: float | None = None  # softmax scale of q·k; None: head_dim ** -0.5
    attn_softcap: float | None = None  # tanh soft-capping of attention logits (Gemma 2)

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of `layer`'s attention, None where it sees its whole context."""
        if self.sliding_window is None or (self.sliding_layers and not self.sliding_layers[layer]):
            return None
        return self.sliding_window

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        return tuple(self.layer_window(i) for i in range(self.num_layers))

    @property
    def attention_scale(self) -> float:
        return self.query_scale if self.query_scale is not None else self.head_dim ** -0.5

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def layer_prefix(self) -> str:
        """Where the decoder layers sit in the checkpoint's (and PEFT's) module names:
        f"{layer_prefix}.{i}.{module_paths()[name]}" is a projection's full module path."""
        return "model.layers"

    def module_paths(self) -> dict[str, str]:
        """Each projection's path inside a decoder layer, keyed by the engine's name for it
        (the keys of module_shapes)."""
        return {name: ("mlp." if name in ("gate_proj", "up_proj", "down_proj") else "self_attn.") + name
                for name in self.module_shapes()}

    def module_shapes(self) -> dict[str, tuple[int, int]]:
        """(in_features, out_features) of every LoRA-targetable projection, keyed by the engine's
        name for it (the same names for every architecture where the math is the same)."""
        h, i = self.hidden_size, self.intermediate_size
        return {
            "q_proj": (h, self.q_dim),
            "k_proj": (h, self.kv_dim),
            "v_proj": (h, self.kv_dim),
            "o_proj": (self.q_dim, h),
            "gate_proj": (h, i),
            "up_proj": (h, i),
            "down_proj": (i, h),
        }

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"no config.json in model directory {model_dir}")
        with path.open() as f:
            raw = json.load(f)
        gen_path = Path(model_dir) / "generation_config.json"
        gen = json.loads(gen_path.read_text()) if gen_path.is_file() else {}
        return cls.from_hf(raw, generation_config=gen)

    @classmethod
    def from_hf(cls, raw: dict[str, Any], generation_config: dict[str, Any] | None = None) -> ModelConfig:
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(
                f"unsupported model_type {model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        _refuse(raw, "quantization_config", lambda v: v is not None, "quantized checkpoints are not supported")
        _refuse(raw, "hidden_act", lambda v: v not in (None, "silu"), "only hidden_act 'silu' is supported")
        _refuse(raw, "pretraining_tp", lambda v: v not in (None, 1), "pretraining_tp > 1 is not supported")
        if model_type == "qwen2" and raw.get("use_sliding_window"):
            raise UnsupportedModelError("unsupported field use_sliding_window=true (Qwen2 per-layer sliding window)")

        hidden = _pos_int(raw, "hidden_size")
        heads = _pos_int(raw, "num_attention_heads")
        kv_heads = int(raw.get("num_key_value_heads") or heads)
        if kv_heads <= 0 or heads % kv_heads:
            raise UnsupportedModelError(
                f"num_key_value_heads={kv_heads} must divide num_attention_heads={heads}"
            )
        head_dim = int(raw.get("head_dim") or hidden // heads)
        if head_dim <= 0 or (raw.get("head_dim") is None and hidden % heads):
            raise UnsupportedModelError(f"hidden_size={hidden} is not divisible by num_attention_heads={heads}")

        sliding = None
        if model_type == "mistral":
            sliding = raw.get("sliding_window")
            if sliding is not None:
                sliding = int(sliding)
        elif model_type == "qwen2":
            sliding = None  # Qwen2 only slides when use_sliding_window is set, refused above

        attention_bias = bool(raw.get("attention_bias", False))
        qkv_bias = model_type == "qwen2" or attention_bias
        eos = _eos_ids(raw, generation_config or {})
        bos = (generation_config or {}).get("bos_token_id", raw.get("bos_token_id"))
        return cls(
            model_type=model_type,
            vocab_size=_pos_int(raw, "vocab_size"),
            hidden_size=hidden,
            intermediate_size=_pos_int(raw, "intermediate_size"),
            num_layers=_pos_int(raw, "num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=float(raw.get("rope_theta", (raw.get("rope_parameters") or {}).get("rope_theta", 10000.0))),
            rope_scaling=_rope_scaling(raw),
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            o_bias=attention_bias and model_type != "qwen2",
            mlp_bias=bool(raw.get("mlp_bias", False)),
            sliding_window=sliding,
            bos_token_id=None if bos is None else int(bos),
            eos_token_ids=eos,
        )


def _refuse(raw: dict[str, Any], key: str, bad, why: str) -> None:
    if key in raw and bad(raw[key]):
        raise UnsupportedModelError(f"unsupported field {key}={raw[key]!r}: {why}")


def _pos_int(raw: dict[str, Any], key: str) -> int:
    value = raw.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise UnsupportedModelError(f"config field {key} must be a positive integer, got {value!r}")
    return value


def _eos_ids(raw: dict[str, Any], gen: dict[str, Any]) -> tuple[int, ...]:
    eos = gen.get("eos_token_id", raw.get("eos_token_id"))
    if eos is None:
        return ()
    if isinstance(eos, int):
        return (eos,)
    return tuple(int(e) for e in eos)


def _rope_scaling(raw: dict[str, Any]) -> RopeScaling:
    scaling = raw.get("rope_scaling")
    # transformers 5 writes rope_parameters; it holds rope_type "default" when unscaled.
    if scaling is None and isinstance(raw.get("rope_parameters"), dict):
        scaling = raw["rope_parameters"]
    if not scaling:
        return RopeScaling()
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"unsupported rope_scaling.rope_type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    factor = float(scaling.get("factor", 1.0))
    if not math.isfinite(factor) or factor <= 0:
        raise UnsupportedModelError(f"rope_scaling.factor must be positive, got {factor!r}")
    if rope_type == "llama3":
        return RopeScaling(
            rope_type="llama3",
            factor=factor,
            low_freq_factor=float(scaling["low_freq_factor"]),
            high_freq_factor=float(scaling["high_freq_factor"]),
            original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
        )
    return RopeScaling(rope_type=rope_type, factor=factor)
