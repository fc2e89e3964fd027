"""The random demo: a tiny random-weight Llama (or a model of another served family,
`family`), its tokenizer and six LoRA adapters.

Owns the random demo's config and adapter list (its cache location is
loraplex.contracts.demo's, torch-free); `install.py` installs it all-or-nothing.
The exact-parity tests and benchmarks use it; the trained demo (`packaged.py`) is
what serves by default.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping

from loraplex.contracts.demo import random_demo_dir  # torch-free: the CLI lists the demo too

from .adapter import write_random_adapter
from .checkpoint import llama_config, write_random_checkpoint
from .families import FAMILIES, family_config
from .install import ensure_installed
from .tokenizer import VOCAB_SIZE, write_tokenizer

DEMO_VERSION = "loraplex-demo-v1"
MODEL_SEED = 1234


@dataclass(frozen=True, slots=True)
class DemoAdapterSpec:
    """One demo adapter: its directory name and LoRA hyperparameters."""

    name: str
    rank: int
    alpha: float
    target_modules: tuple[str, ...]
    seed: int
    use_rslora: bool = False


DEMO_ADAPTERS: tuple[DemoAdapterSpec, ...] = (
    DemoAdapterSpec("qv-r8", 8, 16.0, ("q_proj", "v_proj"), seed=101),
    DemoAdapterSpec("attn-r16", 16, 32.0, ("q_proj", "k_proj", "v_proj", "o_proj"), seed=102),
    DemoAdapterSpec(
        "all-r32",
        32,
        32.0,
        ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
        seed=103,
    ),
    DemoAdapterSpec("mlp-r64", 64, 64.0, ("gate_proj", "up_proj", "down_proj"), seed=104),
    DemoAdapterSpec("rslora-r16", 16, 16.0, ("q_proj", "v_proj", "o_proj"), seed=105, use_rslora=True),
    DemoAdapterSpec("kdown-r8", 8, 8.0, ("k_proj", "down_proj"), seed=106),
)


@dataclass(frozen=True, slots=True)
class DemoModel:
    """Where an installed demo lives: its root, base model dir and adapter dirs."""

    root: Path
    model_dir: Path
    adapters: Mapping[str, Path]  # name -> adapter dir, read-only, in DEMO_ADAPTERS order


def demo_model_config(family: str = "llama") -> dict[str, Any]:
    """config.json of the demo base model (GQA Llama, vocab = demo tokenizer's), or of the same
    shape in another served family (demo/families.py)."""
    if family != "llama":
        return family_config(family, hidden_size=256, intermediate_size=704, num_hidden_layers=4,
                             num_attention_heads=8, num_key_value_heads=4, head_dim=32, vocab_size=VOCAB_SIZE,
                             max_position_embeddings=4096)
    return llama_config(
        hidden_size=256,
        intermediate_size=704,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=32,
        vocab_size=VOCAB_SIZE,
        max_position_embeddings=4096,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )


def _describe(root: Path) -> DemoModel:
    adapters = {spec.name: root / "adapters" / spec.name for spec in DEMO_ADAPTERS}
    return DemoModel(root=root, model_dir=root / "model", adapters=MappingProxyType(adapters))


def family_targets(config: dict[str, Any], targets: tuple[str, ...]) -> list[str]:
    """A demo adapter's Llama targets as `config`'s family names its modules: q/k/v become a fused
    qkv_proj, gate/up a fused gate_up_proj; a gate the family lacks is dropped."""
    from loraplex.gpu_engine.model.config import ModelConfig

    shapes = ModelConfig.from_hf(config).module_shapes()
    fused = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "gate_proj": "gate_up_proj",
             "up_proj": "gate_up_proj"}
    out = {t if t in shapes else fused.get(t, t) for t in targets}
    return sorted(t for t in out if t in shapes)


def _write_demo(root: Path, family: str = "llama") -> None:
    """Write every demo file into `root` (the installer adds DONE last)."""
    model_dir = root / "model"
    config = demo_model_config(family)
    write_random_checkpoint(model_dir, config, seed=MODEL_SEED)
    write_tokenizer(model_dir)
    generation = {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]}
    (model_dir / "generation_config.json").write_text(json.dumps(generation, indent=2, sort_keys=True) + "\n")
    for spec in DEMO_ADAPTERS:
        write_random_adapter(
            root / "adapters" / spec.name,
            config,
            rank=spec.rank,
            alpha=spec.alpha,
            target_modules=family_targets(config, spec.target_modules),
            seed=spec.seed,
            use_rslora=spec.use_rslora,
        )


def ensure_demo_model(dest: Path | None = None, *, force: bool = False, family: str = "llama") -> DemoModel:
    """Return the random demo of `family` (one of demo.families.FAMILIES) at `dest` (default:
    default_demo_dir(), suffixed -<family> for a family other than llama), writing it first if
    missing, stale or forced."""
    if family not in FAMILIES:
        raise ValueError(f"demo family must be one of {', '.join(FAMILIES)}, got {family!r}")
    if dest is None:
        dest = random_demo_dir(family)
    version = DEMO_VERSION if family == "llama" else f"{DEMO_VERSION}-{family}"
    root = ensure_installed(Path(dest), version, lambda r: _write_demo(r, family), force=force)
    return _describe(root)
