"""Load a HuggingFace checkpoint of any family ModelConfig reads (single or sharded safetensors)
into typed per-layer weight holders on the target device and dtype, or build
random weights of the config's shapes on the device (load format `dummy`, for
benchmarks at real model sizes without a checkpoint on disk).

Safetensors only: pickled checkpoints are refused, never unpickled. Every
tensor is checked against the config's shapes; unknown tensors are refused
rather than silently ignored (a Gemma 3 checkpoint's vision tower is read past
by its named prefixes, cfg.skipped_prefixes). GPT-2's Conv1D weights are stored
[in, out] and transposed here. A `select` reads only part of every tensor out of
the files (a tensor-parallel rank's shard: gpu_engine/tp/partition.py's
rank_selector), after the same checks on the full shapes.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors import safe_open

from loraplex.gpu_engine.model.config import ModelConfig, UnsupportedModelError
from loraplex.gpu_engine.model.families import GEMMA3_KEY_RENAMES

_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)

# (the engine's name of the tensor's module: a projection name as in ModelConfig.module_shapes,
#  "embed_tokens", "lm_head", "norm", else the key's last module; "weight" or "bias"; the safetensors
#  slice of the whole tensor) -> the part of it to keep
Selector = Callable[[str, str, Any], torch.Tensor]


@dataclass(slots=True)
class LayerWeights:
    input_norm: torch.Tensor
    post_norm: torch.Tensor | None  # the MLP's input norm; None where attention and MLP share one (Phi)
    proj: dict[str, torch.Tensor]  # module name -> [out, in]
    bias: dict[str, torch.Tensor]  # module name -> [out], only where the checkpoint has one
    # The other norms by cfg.norm_paths() name (attn_out_norm, mlp_out_norm, q_norm, k_norm), and
    # every norm's bias under a LayerNorm family (keyed like the norms: input_norm, post_norm).
    norms: dict[str, torch.Tensor] = field(default_factory=dict)
    norm_bias: dict[str, torch.Tensor] = field(default_factory=dict)

    def norm(self, name: str) -> torch.Tensor | None:
        return getattr(self, name) if name in ("input_norm", "post_norm") else self.norms.get(name)


@dataclass(slots=True)
class ModelWeights:
    embed: torch.Tensor  # [vocab, hidden]
    layers: list[LayerWeights]
    norm: torch.Tensor
    lm_head: torch.Tensor  # [vocab, hidden]; the embedding itself when tied
    norm_bias: torch.Tensor | None = None  # the final LayerNorm's (GPT-2, Phi)
    lm_head_bias: torch.Tensor | None = None  # [vocab] (Phi)
    pos_embed: torch.Tensor | None = None  # [positions, hidden] learned positions (GPT-2)

    def to(self, device: torch.device) -> ModelWeights:
        """The same weights on `device` (itself when already there); a tied LM head stays tied."""
        if self.embed.device == device:
            return self

        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device)

        layers = [LayerWeights(input_norm=move(lw.input_norm), post_norm=move(lw.post_norm),
                               proj={n: move(w) for n, w in lw.proj.items()},
                               bias={n: move(b) for n, b in lw.bias.items()},
                               norms={n: move(w) for n, w in lw.norms.items()},
                               norm_bias={n: move(b) for n, b in lw.norm_bias.items()}) for lw in self.layers]
        embed = move(self.embed)
        return ModelWeights(embed=embed, layers=layers, norm=move(self.norm),
                            lm_head=embed if self.lm_head is self.embed else move(self.lm_head),
                            norm_bias=move(self.norm_bias), lm_head_bias=move(self.lm_head_bias),
                            pos_embed=move(self.pos_embed))


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


def read_top_tensor(model_dir: str | Path, cfg: ModelConfig, which: str) -> torch.Tensor:
    """The checkpoint's "embed" or "lm_head" weight as stored (a tied LM head is the embedding)."""
    key = cfg.top_paths()["embed" if which == "embed" or cfg.tie_word_embeddings else "lm_head"] + ".weight"
    for file in checkpoint_files(Path(model_dir)):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for stored in f.keys():
                if _canonical_key(cfg, stored) == key:
                    return f.get_tensor(stored)
    raise UnsupportedModelError(f"the checkpoint in {model_dir} has no tensor {key}")


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the checkpoint must hold, with its shape as stored (Conv1D: [in, out])."""
    h = cfg.hidden_size
    top = cfg.top_paths()
    layer_norm = cfg.norm == "layer"
    shapes: dict[str, tuple[int, ...]] = {top["embed"] + ".weight": (cfg.vocab_size, h),
                                          top["norm"] + ".weight": (h,)}
    if layer_norm:
        shapes[top["norm"] + ".bias"] = (h,)
    if not cfg.tie_word_embeddings:
        shapes[top["lm_head"] + ".weight"] = (cfg.vocab_size, h)
    if cfg.lm_head_bias:
        shapes[top["lm_head"] + ".bias"] = (cfg.vocab_size,)
    if cfg.learned_positions:
        shapes[top["pos_embed"] + ".weight"] = (cfg.max_position_embeddings, h)
    paths = cfg.module_paths()
    for i in range(cfg.num_layers):
        p = f"{cfg.layer_prefix}.{i}."
        for name, path in cfg.norm_paths().items():
            shapes[p + path + ".weight"] = (cfg.head_dim,) if name in ("q_norm", "k_norm") else (h,)
            if layer_norm:
                shapes[p + path + ".bias"] = (h,)
        for name, (fan_in, fan_out) in cfg.module_shapes().items():
            shapes[p + paths[name] + ".weight"] = (fan_in, fan_out) if cfg.conv1d else (fan_out, fan_in)
            if _has_bias(cfg, name):
                shapes[p + paths[name] + ".bias"] = (fan_out,)
    return shapes


def _has_bias(cfg: ModelConfig, name: str) -> bool:
    if name in ("q_proj", "k_proj", "v_proj", "qkv_proj"):
        return cfg.qkv_bias
    if name == "o_proj":
        return cfg.o_bias
    return cfg.mlp_bias


def _canonical_key(cfg: ModelConfig, key: str) -> str:
    """A Gemma 3 checkpoint's key in the live model's names (the layout transformers saves is older);
    a GPT-2 checkpoint saved from the bare GPT2Model (the original `gpt2` files: h.0..., wte) under
    the transformer. prefix GPT2LMHeadModel gives them."""
    if cfg.model_type == "gpt2" and not key.startswith(("transformer.", "lm_head.")):
        return "transformer." + key
    if cfg.skipped_prefixes:
        for old, new in GEMMA3_KEY_RENAMES:
            if key.startswith(old):
                return new + key[len(old):]
    return key


def _skipped(cfg: ModelConfig, key: str) -> bool:
    """Tensors the engine never uses: RoPE buffers, a tied head's copy, GPT-2's causal-mask buffers,
    another tower's weights (by the prefixes cfg names)."""
    if key.endswith(_IGNORED_SUFFIXES) or key.startswith(cfg.skipped_prefixes):
        return True
    if cfg.model_type == "gpt2" and key.endswith((".attn.bias", ".attn.masked_bias")):
        return True
    return key == cfg.top_paths()["lm_head"] + ".weight" and cfg.tie_word_embeddings


def engine_module_names(cfg: ModelConfig) -> dict[str, str]:
    """The engine's name of each module path of the checkpoint that a Selector must tell apart: the
    projections (Phi's `self_attn.dense` is o_proj, GPT-2's `mlp.c_fc` up_proj) and the tensors outside
    the layers. Other modules (norms) go by their own last name."""
    top = cfg.top_paths()
    names = {top["embed"]: "embed_tokens", top["lm_head"]: "lm_head", top["norm"]: "norm"}
    for i in range(cfg.num_layers):
        names |= {f"{cfg.layer_prefix}.{i}.{path}": name for name, path in cfg.module_paths().items()}
    return names


def load_weights(model_dir: str | Path, cfg: ModelConfig, *, device: torch.device,
                 dtype: torch.dtype, select: Selector | None = None) -> ModelWeights:
    """The checkpoint's weights on `device` in `dtype`: whole, or what `select` keeps of every tensor
    (read from the file as that part only; a tied LM head stays the selected embedding)."""
    model_dir = Path(model_dir)
    want = expected_shapes(cfg)
    got: dict[str, torch.Tensor] = {}
    names = engine_module_names(cfg) if select is not None else {}
    if select is not None and cfg.conv1d:
        raise UnsupportedModelError(f"{cfg.model_type}: Conv1D weights are not read per rank")
    for file in checkpoint_files(model_dir):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for stored in f.keys():
                key = _canonical_key(cfg, stored)
                if _skipped(cfg, key):
                    continue
                if key not in want:
                    raise UnsupportedModelError(f"unexpected tensor {key!r} in {file.name} for this config")
                part = f.get_slice(stored)  # lazy: nothing read yet
                shape = tuple(part.get_shape())
                if shape != want[key]:
                    raise UnsupportedModelError(f"tensor {key} has shape {shape}, expected {want[key]}")
                if select is None:
                    t = f.get_tensor(stored)
                else:
                    module, param = key.rsplit(".", 1)
                    t = select(names.get(module, module.rsplit(".", 1)[-1]), param, part)
                if cfg.conv1d and t.dim() == 2 and key.startswith(cfg.layer_prefix + "."):
                    t = t.t()  # Conv1D [in, out] -> [out, in]
                got[key] = t.to(device=device, dtype=dtype).contiguous()
    missing = sorted(set(want) - set(got))
    if missing:
        raise UnsupportedModelError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:3]}")
    return _assemble(cfg, got)


def _assemble(cfg: ModelConfig, got: dict[str, torch.Tensor]) -> ModelWeights:
    layers = []
    paths = cfg.module_paths()
    for i in range(cfg.num_layers):
        p = f"{cfg.layer_prefix}.{i}."
        norms = {n: got[p + path + ".weight"] for n, path in cfg.norm_paths().items()}
        biases = {n: got[p + path + ".bias"] for n, path in cfg.norm_paths().items() if p + path + ".bias" in got}
        layers.append(LayerWeights(
            input_norm=norms.pop("input_norm"),
            post_norm=norms.pop("post_norm", None),
            proj={n: got[p + paths[n] + ".weight"] for n in cfg.module_shapes()},
            bias={n: got[p + paths[n] + ".bias"] for n in cfg.module_shapes() if _has_bias(cfg, n)},
            norms=norms, norm_bias=biases,
        ))
    top = cfg.top_paths()
    embed = got[top["embed"] + ".weight"]
    return ModelWeights(embed=embed, layers=layers, norm=got[top["norm"] + ".weight"],
                        lm_head=embed if cfg.tie_word_embeddings else got[top["lm_head"] + ".weight"],
                        norm_bias=got.get(top["norm"] + ".bias"), lm_head_bias=got.get(top["lm_head"] + ".bias"),
                        pos_embed=got.get(top.get("pos_embed", "") + ".weight"))


def random_weights(cfg: ModelConfig, *, device: torch.device, dtype: torch.dtype, seed: int = 0) -> ModelWeights:
    """Random weights of `cfg`'s shapes made on `device` (nothing read from disk): projections scaled by
    fan_in^-0.5 so activations stay finite through every layer, norms neutral (ones, or zeros where
    the norm multiplies by 1 + w), biases small."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def rand(*shape: int, std: float) -> torch.Tensor:
        return (torch.randn(*shape, device=device, dtype=torch.float32, generator=gen) * std).to(dtype)

    def neutral(width: int = cfg.hidden_size) -> torch.Tensor:
        fill = 0.0 if cfg.norm == "rms1p" else 1.0
        return torch.full((width,), fill, device=device, dtype=dtype)

    def layer_norm_bias() -> dict[str, torch.Tensor]:
        return {n: torch.zeros(cfg.hidden_size, device=device, dtype=dtype)
                for n in cfg.norm_paths() if n in ("input_norm", "post_norm")} if cfg.norm == "layer" else {}

    shapes = cfg.module_shapes()
    extra = [n for n in cfg.norm_paths() if n not in ("input_norm", "post_norm")]
    layers = [LayerWeights(input_norm=neutral(), post_norm=neutral() if "post_norm" in cfg.norm_paths() else None,
                           proj={n: rand(fo, fi, std=fi ** -0.5) for n, (fi, fo) in shapes.items()},
                           bias={n: rand(fo, std=0.02) for n, (fi, fo) in shapes.items() if _has_bias(cfg, n)},
                           norms={n: neutral(cfg.head_dim if n in ("q_norm", "k_norm") else cfg.hidden_size)
                                  for n in extra},
                           norm_bias=layer_norm_bias())
              for _ in range(cfg.num_layers)]
    # A tied embedding (the LM head too) is kept small beside the layers' outputs, the final norm's
    # gain making the logits' std ~4 (else the last input token dominates and greedy repeats it).
    tied = cfg.tie_word_embeddings
    embed_std = 0.3 / (cfg.hidden_size ** 0.5 if cfg.embed_scaled else 1.0) if tied else 1.0
    embed = rand(cfg.vocab_size, cfg.hidden_size, std=embed_std)
    zeros = torch.zeros(cfg.hidden_size, device=device, dtype=dtype)
    final = neutral()
    if tied:
        final = final + 4.0 / (cfg.hidden_size ** 0.5 * embed_std) - 1.0
    return ModelWeights(embed=embed, layers=layers, norm=final,
                        lm_head=embed if cfg.tie_word_embeddings else rand(cfg.vocab_size, cfg.hidden_size, std=0.02),
                        norm_bias=zeros if cfg.norm == "layer" else None,
                        lm_head_bias=rand(cfg.vocab_size, std=0.02) if cfg.lm_head_bias else None,
                        pos_embed=rand(cfg.max_position_embeddings, cfg.hidden_size, std=0.02)
                        if cfg.learned_positions else None)
