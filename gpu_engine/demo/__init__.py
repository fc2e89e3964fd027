"""The built-in demos: a trained Shakespeare Llama with style adapters, and a random one.

`builtin_demo()` is what serves without a model ($LORAPLEX_DEMO: `trained`, the
default, or `random`). The trained demo is committed under `trained/` and rebuilt
by `python -m loraplex.gpu_engine.demo.train`; the random demo (`ensure_demo_model()`)
is generated locally from fixed seeds and is the exact-parity tests' fixture.
Nothing here downloads anything.
"""
from __future__ import annotations

from loraplex.contracts.demo import default_demo_dir

from .adapter import write_random_adapter
from .builtin import DEMO_ENV, DEMO_KINDS, builtin_demo, builtin_demo_kind
from .checkpoint import llama_config, mistral_config, qwen2_config, write_random_checkpoint
from .families import FAMILIES, family_config
from .model import DEMO_ADAPTERS, DemoAdapterSpec, DemoModel, demo_model_config, ensure_demo_model
from .packaged import TRAINED_ADAPTERS, TRAINED_DIR, install_trained_demo, trained_demo
from .styles import STYLES, Style
from .tokenizer import build_demo_tokenizer, write_tokenizer

__all__ = [
    "DEMO_ADAPTERS",
    "DEMO_ENV",
    "DEMO_KINDS",
    "STYLES",
    "TRAINED_ADAPTERS",
    "TRAINED_DIR",
    "DemoAdapterSpec",
    "DemoModel",
    "FAMILIES",
    "Style",
    "build_demo_tokenizer",
    "builtin_demo",
    "builtin_demo_kind",
    "default_demo_dir",
    "demo_model_config",
    "ensure_demo_model",
    "family_config",
    "install_trained_demo",
    "llama_config",
    "mistral_config",
    "qwen2_config",
    "trained_demo",
    "write_random_adapter",
    "write_random_checkpoint",
    "write_tokenizer",
]
