"""Model configuration: parse and validate a HuggingFace config.json for the
architectures the engine runs (Llama, Mistral, Qwen2/3, Gemma 1/2/3, Phi, Phi-3,
GPT-2), into one typed ModelConfig whose per-family facts drive the one forward.

Owns the one place where HF field names are read (with families.py for the
per-family parts) and where checkpoint names live (layer_prefix, module_paths,
norm_paths, top_paths). Anything the executor would silently get wrong is
refused here with an error naming the field.
"""
from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loraplex.contracts.head_modules import HeadModule, head_modules
from loraplex.gpu_engine.model import families
from loraplex.gpu_engine.model.families import SUPPORTED_MODEL_TYPES

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope")


class UnsupportedModelError(ValueError):
    """The checkpoint uses a feature the engine does not implement."""


@dataclass(frozen=True, slots=True)
class RopeScaling:
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    # longrope (Phi-3; "su" is its old name): per-frequency divisors up to / past the original length
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    attention_factor: float = 1.0  # cos and sin are multiplied by it


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
    # The decoder layer's shape (families.py sets these per family; the defaults are Llama's).
    norm: str = "rms"  # "rms": w·norm(x); "rms1p": (1 + w)·norm(x) in float32 (Gemma); "layer": LayerNorm + bias
    activation: str = "silu"  # "silu" or "gelu_tanh"
    gated_mlp: bool = True  # act(gate)·up; False: act(up) (GPT-2, Phi)
    fused_qkv: bool = False  # one qkv_proj (Phi-3, GPT-2's c_attn), split after its LoRA
    fused_gate_up: bool = False  # one gate_up_proj (Phi-3)
    qk_norm: bool = False  # per-head RMSNorm of q and k before RoPE (Qwen3, Gemma 3)
    embed_scaled: bool = False  # embeddings times sqrt(hidden) in the model dtype (Gemma)
    sandwich_norm: bool = False  # norms after attention and after the MLP too (Gemma 2/3)
    parallel_residual: bool = False  # attention and MLP read one normed input, both added (Phi)
    learned_positions: bool = False  # absolute position embeddings added to the input (GPT-2)
    rotary_dim: int | None = None  # leading dims of each head RoPE rotates (None: all; 0: no RoPE)
    local_rope_theta: float | None = None  # RoPE base of sliding layers, unscaled (Gemma 3)
    final_softcap: float | None = None  # tanh soft-capping of the output logits (Gemma 2)
    lm_head_bias: bool = False
    weights_prefix: str = "model"  # the decoder's module path in the checkpoint
    skipped_prefixes: tuple[str, ...] = ()  # checkpoint tensors of other towers, read past (Gemma 3's vision)
    # The checkpoint directory (from_dir): adapters that ship copies of its embedding or LM head
    # (peft's save_embedding_layers) are checked against it.
    model_dir: str | None = None

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
    def rope_dim(self) -> int:
        return self.head_dim if self.rotary_dim is None else self.rotary_dim

    @property
    def layer_prefix(self) -> str:
        """Where the decoder layers sit in the checkpoint's (and PEFT's) module names:
        f"{layer_prefix}.{i}.{module_paths()[name]}" is a projection's full module path."""
        return "transformer.h" if self.model_type == "gpt2" else f"{self.weights_prefix}.layers"

    def module_paths(self) -> dict[str, str]:
        """Each projection's path inside a decoder layer, keyed by the engine's name for it
        (the keys of module_shapes)."""
        if self.model_type == "gpt2":
            paths = {"qkv_proj": "attn.c_attn", "o_proj": "attn.c_proj", "up_proj": "mlp.c_fc",
                     "down_proj": "mlp.c_proj"}
        elif self.model_type == "phi":
            paths = {"q_proj": "self_attn.q_proj", "k_proj": "self_attn.k_proj", "v_proj": "self_attn.v_proj",
                     "o_proj": "self_attn.dense", "up_proj": "mlp.fc1", "down_proj": "mlp.fc2"}
        else:
            paths = {name: ("mlp." if name in ("gate_proj", "up_proj", "down_proj", "gate_up_proj")
                            else "self_attn.") + name for name in self.module_shapes()}
        return paths

    def module_shapes(self) -> dict[str, tuple[int, int]]:
        """(in_features, out_features) of every LoRA-targetable projection, keyed by the engine's
        name for it (the same names for every architecture where the math is the same; a fused
        qkv_proj is q, k, v concatenated on the output axis, gate_up_proj gate then up)."""
        h, i = self.hidden_size, self.intermediate_size
        shapes: dict[str, tuple[int, int]] = {}
        if self.fused_qkv:
            shapes["qkv_proj"] = (h, self.q_dim + 2 * self.kv_dim)
        else:
            shapes.update(q_proj=(h, self.q_dim), k_proj=(h, self.kv_dim), v_proj=(h, self.kv_dim))
        shapes["o_proj"] = (self.q_dim, h)
        if self.fused_gate_up:
            shapes["gate_up_proj"] = (h, 2 * i)
        elif self.gated_mlp:
            shapes.update(gate_proj=(h, i), up_proj=(h, i))
        else:
            shapes["up_proj"] = (h, i)
        shapes["down_proj"] = (i, h)
        return shapes

    def head_modules(self) -> dict[str, HeadModule]:
        """LoRA-targetable modules outside the layers (embed_tokens, lm_head), each spread over
        the layers (contracts/head_modules.py)."""
        paths = self.top_paths()
        widest = max(max(shape) for shape in self.module_shapes().values())
        return head_modules(hidden_size=self.hidden_size, vocab_size=self.vocab_size, num_layers=self.num_layers,
                            widest_row=widest, embed_path=paths["embed"], lm_head_path=paths["lm_head"])

    def adapter_shapes(self) -> dict[str, tuple[int, int]]:
        """(in, out) per layer of everything an adapter may target: module_shapes(), then each head
        module's part per layer. What the host store and the pool lay out."""
        return {**self.module_shapes(), **{n: m.per_layer_shape for n, m in self.head_modules().items()}}

    @property
    def conv1d(self) -> bool:
        """Projections stored [in, out] (GPT-2's Conv1D), transposed at load."""
        return self.model_type == "gpt2"

    def norm_paths(self) -> dict[str, str]:
        """Each norm's path inside a decoder layer, keyed by the engine's name for it: input_norm
        (before attention), post_norm (before the MLP), attn_out_norm / mlp_out_norm (Gemma 2/3's
        norms of the attention and MLP outputs), q_norm / k_norm (per head)."""
        if self.model_type == "gpt2":
            return {"input_norm": "ln_1", "post_norm": "ln_2"}
        paths = {"input_norm": "input_layernorm"}
        if self.sandwich_norm:
            paths.update(attn_out_norm="post_attention_layernorm", post_norm="pre_feedforward_layernorm",
                         mlp_out_norm="post_feedforward_layernorm")
        elif not self.parallel_residual:
            paths["post_norm"] = "post_attention_layernorm"
        if self.qk_norm:
            paths.update(q_norm="self_attn.q_norm", k_norm="self_attn.k_norm")
        return paths

    def top_paths(self) -> dict[str, str]:
        """Module paths of the tensors outside the layers: embed, norm (final), lm_head, pos_embed."""
        if self.model_type == "gpt2":
            return {"embed": "transformer.wte", "norm": "transformer.ln_f", "lm_head": "lm_head",
                    "pos_embed": "transformer.wpe"}
        norm = "final_layernorm" if self.model_type == "phi" else "norm"
        return {"embed": f"{self.weights_prefix}.embed_tokens", "norm": f"{self.weights_prefix}.{norm}",
                "lm_head": "lm_head"}

    def tp_blocker(self) -> str | None:
        """Why this model cannot run tensor-parallel (None: it can, where its head counts split)."""
        if self.conv1d or self.learned_positions:
            return f"{self.model_type}: Conv1D weights and learned positions are not split per rank yet; " \
                   "serve it with tensor_parallel_size=1"
        return None

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"no config.json in model directory {model_dir}")
        with path.open() as f:
            raw = json.load(f)
        gen_path = Path(model_dir) / "generation_config.json"
        gen = json.loads(gen_path.read_text()) if gen_path.is_file() else {}
        return dataclasses.replace(cls.from_hf(raw, generation_config=gen), model_dir=str(Path(model_dir)))

    @classmethod
    def from_hf(cls, raw: dict[str, Any], generation_config: dict[str, Any] | None = None) -> ModelConfig:
        try:
            return cls._from_hf(raw, generation_config or {})
        except families.FamilyError as e:
            raise UnsupportedModelError(str(e)) from None

    @classmethod
    def _from_hf(cls, outer: dict[str, Any], gen: dict[str, Any]) -> ModelConfig:
        outer_type = outer.get("model_type")
        if outer_type in families.REFUSED:
            raise UnsupportedModelError(f"unsupported model_type {outer_type!r}: {families.REFUSED[outer_type]}")
        if outer_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(
                f"unsupported model_type {outer_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        _refuse(outer, "quantization_config", lambda v: v is not None, "quantized checkpoints are not supported")
        raw, prefix = families.normalize(outer)
        model_type = raw["model_type"]
        _refuse(raw, "pretraining_tp", lambda v: v not in (None, 1), "pretraining_tp > 1 is not supported")

        hidden = _pos_int(raw, "hidden_size")
        heads = _pos_int(raw, "num_attention_heads")
        num_layers = _pos_int(raw, "num_hidden_layers")
        kv_heads = int(raw.get("num_key_value_heads") or heads)
        if kv_heads <= 0 or heads % kv_heads:
            raise UnsupportedModelError(
                f"num_key_value_heads={kv_heads} must divide num_attention_heads={heads}"
            )
        head_dim = int(raw.get("head_dim") or hidden // heads)
        if head_dim <= 0 or (raw.get("head_dim") is None and hidden % heads):
            raise UnsupportedModelError(f"hidden_size={hidden} is not divisible by num_attention_heads={heads}")

        fam = families.facts(raw, model_type, head_dim)
        sliding = families.sliding_window(raw, model_type)
        sliding_layers = families.layer_types(raw, model_type, num_layers) if sliding is not None else None
        if sliding is not None and sliding_layers is not None and not any(sliding_layers):
            sliding = None  # no layer slides (Qwen2/3 with max_window_layers >= num_layers)

        attention_bias = bool(raw.get("attention_bias", False)) or fam.pop("attn_bias", False)
        qkv_bias = model_type == "qwen2" or attention_bias
        mlp_bias = bool(raw.get("mlp_bias", False)) or fam.pop("mlp_bias", False)
        tied = bool(raw.get("tie_word_embeddings", fam.pop("tie_default", False)))
        layered = model_type == "gemma3_text"  # rope_parameters keyed by layer type
        rope = families.rope_params(raw, "full_attention" if layered else None)
        rope_theta = float(raw.get("rope_theta") or rope.get("rope_theta") or (1e6 if layered else 10000.0))
        local_theta = None
        if layered:
            local = families.rope_params(raw, "sliding_attention")
            local_theta = float(raw.get("rope_local_base_freq") or local.get("rope_theta") or 10000.0)
            if local.get("rope_type", "default") != "default":
                raise UnsupportedModelError("rope_parameters.sliding_attention: only the default RoPE is supported")
        rotary_dim = None
        if fam.pop("rotary", True):
            factor = float(raw.get("partial_rotary_factor") or rope.get("partial_rotary_factor")
                           or (0.5 if model_type == "phi" else 1.0))
            if not 0.0 < factor <= 1.0 or int(head_dim * factor) % 2:
                raise UnsupportedModelError(f"partial_rotary_factor={factor} must give an even rotary width")
            rotary_dim = None if factor == 1.0 else int(head_dim * factor)
        else:
            rotary_dim = 0
        eos = _eos_ids(raw, gen)
        bos = gen.get("bos_token_id", raw.get("bos_token_id"))
        max_pos = int(raw.get("max_position_embeddings", 2048))
        return cls(
            model_type=model_type,
            vocab_size=_pos_int(raw, "vocab_size"),
            hidden_size=hidden,
            intermediate_size=_pos_int(raw, "intermediate_size"),
            num_layers=num_layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=_rope_scaling(rope, raw, max_pos),
            max_position_embeddings=max_pos,
            tie_word_embeddings=tied,
            qkv_bias=qkv_bias,
            o_bias=attention_bias and model_type != "qwen2",
            mlp_bias=mlp_bias,
            sliding_window=sliding,
            bos_token_id=None if bos is None else int(bos),
            eos_token_ids=eos,
            sliding_layers=sliding_layers or (),
            rotary_dim=rotary_dim,
            local_rope_theta=local_theta,
            weights_prefix=prefix,
            skipped_prefixes=families.GEMMA3_SKIPPED_PREFIXES if outer_type == "gemma3" else (),
            **fam,
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


def _rope_scaling(scaling: dict[str, Any], raw: dict[str, Any], max_pos: int) -> RopeScaling:
    # transformers 5 writes rope_parameters; it holds rope_type "default" when unscaled.
    if not scaling:
        return RopeScaling()
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "su":
        rope_type = "longrope"  # its old name, as transformers' Phi-3 config reads it
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"unsupported rope_scaling.rope_type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if rope_type == "longrope":
        return _longrope(scaling, raw, max_pos)
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


def _longrope(scaling: dict[str, Any], raw: dict[str, Any], max_pos: int) -> RopeScaling:
    """As transformers 5.24's _compute_longrope_parameters: factor defaults to max/original length,
    the attention factor to sqrt(1 + ln(factor) / ln(original))."""
    original = scaling.get("original_max_position_embeddings", raw.get("original_max_position_embeddings"))
    if not isinstance(original, int) or original <= 0:
        raise UnsupportedModelError("longrope needs a positive original_max_position_embeddings")
    short, long = scaling.get("short_factor"), scaling.get("long_factor")
    if not isinstance(short, list) or not isinstance(long, list) or len(short) != len(long) or not short:
        raise UnsupportedModelError("rope_scaling.short_factor and long_factor must be lists of one length")
    factor = scaling.get("factor")
    factor = max_pos / original if factor is None else float(factor)
    attention = scaling.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return RopeScaling(rope_type="longrope", factor=factor, original_max_position_embeddings=original,
                       short_factor=tuple(float(x) for x in short), long_factor=tuple(float(x) for x in long),
                       attention_factor=float(attention))
