"""The built-in demo model: random HF checkpoints, PEFT adapters and a tokenizer.

Everything here is generated locally from fixed seeds; nothing is downloaded.
`ensure_demo_model()` installs the demo used by `loraplex demo-model` and the tests.
"""
from __future__ import annotations

from .adapter import write_random_adapter
from .checkpoint import llama_config, mistral_config, qwen2_config, write_random_checkpoint
from .model import DEMO_ADAPTERS, DemoAdapterSpec, DemoModel, default_demo_dir, demo_model_config, ensure_demo_model
from .tokenizer import build_demo_tokenizer, write_tokenizer

__all__ = [
    "DEMO_ADAPTERS",
    "DemoAdapterSpec",
    "DemoModel",
    "build_demo_tokenizer",
    "default_demo_dir",
    "demo_model_config",
    "ensure_demo_model",
    "llama_config",
    "mistral_config",
    "qwen2_config",
    "write_random_adapter",
    "write_random_checkpoint",
    "write_tokenizer",
]
