"""Model shapes the benchmarks build with random weights (nothing downloaded):
`tiny` for smoke runs anywhere, `cpu` for CPU figures where the model's compute
must dominate a step, Llama-2-7B and Llama-3-8B (GQA) dimensions for
GPU figures. `write_model_dir` writes a config.json-only model directory that an
engine serves with `load_format = "dummy"`.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch

from loraplex.gpu_engine.demo.checkpoint import llama_config
from loraplex.gpu_engine.runtime import DTYPES

SHAPES: dict[str, dict[str, Any]] = {
    "tiny": dict(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, vocab_size=512),
    # ~160M parameters: big enough that the model's compute, not Python, fills a step on a 2-core CPU
    "cpu": dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16,
                num_key_value_heads=8, head_dim=64, vocab_size=32000),
    "7b": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=32, head_dim=128, vocab_size=32000),
    # Llama-3-8B: grouped-query attention (8 KV heads), wider MLP, 128k vocabulary
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, head_dim=128, vocab_size=128256, rope_theta=500000.0,
               max_position_embeddings=8192),
}


def shape_config(shape: str) -> dict[str, Any]:
    """The complete LlamaForCausalLM config.json dict of `shape`."""
    return llama_config(**SHAPES[shape])


def write_model_dir(root: Path, shape: str) -> Path:
    """A model directory holding only config.json (serve it with load_format dummy)."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(shape_config(shape), indent=1))
    return root


def add_model_args(p: argparse.ArgumentParser) -> None:
    """--shape, --device and --dtype, as every script building a random model of SHAPES takes them."""
    p.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default: bfloat16 on cuda, float32 on cpu")


def resolve_model_args(args: argparse.Namespace) -> tuple[torch.device, torch.dtype]:
    """Fill the defaults of add_model_args in place; the torch device and dtype."""
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    args.dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    return torch.device(args.device), DTYPES[args.dtype]
