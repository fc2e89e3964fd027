"""The engine equals transformers + PEFT: greedy tokens and chosen-token logprobs,
in one mixed batch of different adapters, ranks and base-only rows, across many pages."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from loraplex import LLM, SamplingParams
from loraplex.gpu_engine.demo import (
    llama_config,
    mistral_config,
    qwen2_config,
    write_random_adapter,
    write_random_checkpoint,
)
from tests.hf_reference import greedy
from tests.tolerances import forward_tolerance

pytest.importorskip("transformers")
pytest.importorskip("peft")

NEW_TOKENS = 32


def _prompts(seed: int, lengths: list[int], vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def _check(llm: LLM, model_dir: Path, adapter_dirs: dict[str, Path], prompts, names) -> None:
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=True)
    outs = llm.generate(prompts, adapters=names, sampling=params)
    tol = forward_tolerance(llm.config)
    for prompt, name, out in zip(prompts, names, outs):
        ref_tokens, ref_logprobs = greedy(model_dir, adapter_dirs.get(name), prompt, NEW_TOKENS)
        assert out.token_ids == ref_tokens, f"adapter {name}: tokens differ"
        assert len(out.logprobs) == NEW_TOKENS
        worst = max(abs(a - b) for a, b in zip(out.logprobs, ref_logprobs))
        assert worst < tol, f"adapter {name}: logprob error {worst} over {tol:.2g}"
        assert out.finish_reason == "length"


@pytest.mark.parametrize("page_tokens", [4, 16])
def test_demo_mixed_batch_matches_peft(demo, page_tokens):
    llm = LLM(demo.model_dir, page_tokens=page_tokens, num_pages=512)
    for name, path in demo.adapters.items():
        llm.add_adapter(name, path)
    names = [None, "qv-r8", "attn-r16", "all-r32", "mlp-r64", None, "rslora-r16", "kdown-r8"]
    lengths = [41, 170, 77, 200, 160, 12, 95, 180]
    prompts = _prompts(page_tokens, lengths, llm.config.vocab_size)
    # the longest rows must span at least 10 pages of KV
    assert max(lengths) + NEW_TOKENS >= 10 * llm.geometry.page_tokens
    _check(llm, demo.model_dir, dict(demo.adapters), prompts, names)


def _fixture_model(root: Path, config: dict, ranks: dict[str, tuple[int, list[str]]], *, shards: int = 1):
    model_dir = root / "model"
    write_random_checkpoint(model_dir, config, seed=7, num_shards=shards)
    adapters = {}
    for i, (name, (rank, targets)) in enumerate(ranks.items()):
        adapters[name] = root / name
        write_random_adapter(adapters[name], config, rank=rank, alpha=2.0 * rank, target_modules=targets,
                             seed=100 + i, use_rslora=(i == 1))
    return model_dir, adapters


FIXTURES = {
    "gqa-llama3-rope-sharded": (
        llama_config(num_attention_heads=8, num_key_value_heads=2, head_dim=8, max_position_embeddings=8192,
                     rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
        3,
    ),
    "qwen2-bias-tied": (qwen2_config(tie_word_embeddings=True, num_attention_heads=4, num_key_value_heads=2), 1),
    "mistral-sliding-window": (mistral_config(sliding_window=24), 1),
    "llama-linear-rope-bias": (
        llama_config(rope_scaling={"type": "linear", "factor": 2.0}, attention_bias=True, mlp_bias=True), 2,
    ),
}


@pytest.mark.parametrize("kind", sorted(FIXTURES))
def test_architectures_match_peft(tmp_path, kind):
    config, shards = FIXTURES[kind]
    model_dir, adapters = _fixture_model(
        tmp_path, config,
        {"a8": (8, ["q_proj", "v_proj"]), "a16": (16, ["k_proj", "o_proj", "down_proj"]),
         "a32": (32, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])},
        shards=shards,
    )
    llm = LLM(model_dir, page_tokens=8, num_pages=256)
    for name, path in adapters.items():
        llm.add_adapter(name, path)
    names = ["a8", None, "a16", "a32"]
    prompts = _prompts(3, [50, 9, 70, 33], config["vocab_size"])
    _check(llm, model_dir, adapters, prompts, names)
