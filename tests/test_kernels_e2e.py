"""End to end: `LLM(..., lora_backend="triton")` (LoRA and paged attention through
the Triton kernels, interpreted on CPU) reproduces the torch backend's greedy
tokens and logprobs, and transformers + PEFT, on a tiny Llama with adapters of
different ranks and a base-only row; a clear error where Triton cannot run.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the first import of triton
pytest.importorskip("triton")

from loraplex import LLM, SamplingParams  # noqa: E402
from loraplex.gpu_engine.demo import (  # noqa: E402
    llama_config,
    mistral_config,
    write_random_adapter,
    write_random_checkpoint,
)
from loraplex.gpu_engine.model.config import ModelConfig  # noqa: E402
from tests.hf_reference import greedy  # noqa: E402
from tests.tolerances import forward_tolerance  # noqa: E402

# Triton runs compiled on a GPU host (where the interpreter is off), interpreted on CPU.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
NEW_TOKENS = 8
ADAPTERS = {"r4": (4, ["q_proj", "v_proj"]), "r8": (8, ["k_proj", "o_proj", "down_proj"]),
            "r16": (16, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])}
NAMES = ["r16", None, "r4", "r8", "r16"]
LENGTHS = [11, 6, 19, 3, 8]


def write_model(root: Path, config: dict) -> tuple[Path, dict[str, Path]]:
    model_dir = root / "model"
    write_random_checkpoint(model_dir, config, seed=5)
    adapters = {}
    for i, (name, (rank, targets)) in enumerate(ADAPTERS.items()):
        adapters[name] = root / name
        write_random_adapter(adapters[name], config, rank=rank, alpha=2.0 * rank, target_modules=targets,
                             seed=40 + i, use_rslora=(name == "r8"))
    return model_dir, adapters


def generate(model_dir: Path, adapters: dict[str, Path], backend: str, prompts: list[list[int]]):
    # float32: the references are float32 (on CUDA the default would be bfloat16)
    llm = LLM(model_dir, lora_backend=backend, page_tokens=4, num_pages=96, dtype="float32", device=DEVICE)
    for name, path in adapters.items():
        llm.add_adapter(name, path)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=True)
    return llm.generate(prompts, adapters=NAMES, sampling=params)


def prompts_for(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(2)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in LENGTHS]


@pytest.mark.parametrize("kind", ["llama-gqa", pytest.param("mistral-window", marks=pytest.mark.slow)])
def test_triton_engine_matches_torch_and_peft(tmp_path: Path, kind: str) -> None:
    pytest.importorskip("transformers")
    pytest.importorskip("peft")
    config = llama_config() if kind == "llama-gqa" else mistral_config(sliding_window=9)
    model_dir, adapters = write_model(tmp_path, config)
    prompts = prompts_for(config["vocab_size"])
    torch_out = generate(model_dir, adapters, "torch", prompts)
    triton_out = generate(model_dir, adapters, "triton", prompts)
    tol = forward_tolerance(ModelConfig.from_hf(config))
    for name, prompt, ref, got in zip(NAMES, prompts, torch_out, triton_out):
        assert got.token_ids == ref.token_ids, f"adapter {name}: tokens differ from the torch backend"
        worst = max(abs(a - b) for a, b in zip(got.logprobs, ref.logprobs))
        assert worst < tol, f"adapter {name}: logprob differs from the torch backend by {worst}"
        peft_tokens, peft_logprobs = greedy(model_dir, adapters.get(name) if name else None, prompt, NEW_TOKENS)
        assert got.token_ids == peft_tokens, f"adapter {name}: tokens differ from PEFT"
        worst = max(abs(a - b) for a, b in zip(got.logprobs, peft_logprobs))
        assert worst < tol, f"adapter {name}: logprob differs from PEFT by {worst}"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only error")
def test_triton_backend_without_interpreter_or_cuda_explains(tmp_path: Path) -> None:
    model_dir = tmp_path / "model"
    write_random_checkpoint(model_dir, llama_config(), seed=1)
    code = ("from loraplex import LLM\n"
            "try:\n"
            f"    LLM({str(model_dir)!r}, lora_backend='triton', num_pages=8)\n"
            "except ValueError as e:\n"
            "    print(e)\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120,
                          check=False)
    assert proc.returncode == 0, proc.stderr
    assert "TRITON_INTERPRET=1" in proc.stdout and "lora_backend='torch'" in proc.stdout


@pytest.mark.slow
def test_demo_model_mixed_batch_matches_torch_backend(demo) -> None:
    """The built-in demo (4-layer GQA Llama, six adapters of ranks 8-64) through both backends."""
    names = [None, "qv-r8", "attn-r16", "all-r32", "mlp-r64", "rslora-r16", "kdown-r8"]
    outs = {}
    for backend in ("torch", "triton"):
        llm = LLM(demo.model_dir, lora_backend=backend, page_tokens=16, num_pages=64, dtype="float32")
        for name, path in demo.adapters.items():
            llm.add_adapter(name, path)
        g = torch.Generator().manual_seed(9)
        prompts = [torch.randint(3, llm.config.vocab_size, (n,), generator=g).tolist()
                   for n in (5, 21, 9, 30, 3, 12, 17)]
        params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=True)
        outs[backend] = llm.generate(prompts, adapters=names, sampling=params)
    for name, ref, got in zip(names, outs["torch"], outs["triton"]):
        assert got.token_ids == ref.token_ids, f"adapter {name}: tokens differ"
        assert max(abs(a - b) for a, b in zip(got.logprobs, ref.logprobs)) < forward_tolerance(llm.config)
