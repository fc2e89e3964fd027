"""`model.load_format = "dummy"`: random weights of config.json's shapes, made on the
device with nothing read from disk (benchmarks at real sizes), and a clear error
for anything but safetensors or dummy."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from loraplex import LLM, SamplingParams
from loraplex.contracts.engine_spec import EngineSpec
from loraplex.daemon.config import ConfigError, ModelSettings
from loraplex.gpu_engine.demo import llama_config
from loraplex.gpu_engine.model.config import ModelConfig
from loraplex.gpu_engine.model.weights import random_weights


def config_only(tmp_path: Path, **overrides) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(llama_config(**overrides)))
    return tmp_path


def test_dummy_weights_serve_a_config_only_model_deterministically(tmp_path: Path) -> None:
    model = config_only(tmp_path, tie_word_embeddings=True, attention_bias=True)
    g = torch.Generator().manual_seed(int(torch.randint(1 << 30, ())))
    prompts = [torch.randint(3, 512, (int(n),), generator=g).tolist() for n in (5, 17)]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    outs = [[o.token_ids for o in LLM(model, load_format="dummy", num_pages=64).generate(prompts, sampling=params)]
            for _ in range(2)]
    assert outs[0] == outs[1] and all(len(t) == 6 for t in outs[0])
    with pytest.raises(FileNotFoundError):  # without dummy, the missing checkpoint is an error
        LLM(model, num_pages=64)


def test_random_weights_have_the_config_shapes_and_no_zeros() -> None:
    cfg = ModelConfig.from_hf(llama_config(attention_bias=True))
    w = random_weights(cfg, device=torch.device("cpu"), dtype=torch.float32, seed=3)
    assert len(w.layers) == cfg.num_layers and w.embed.shape == (cfg.vocab_size, cfg.hidden_size)
    for name, (fan_in, fan_out) in cfg.module_shapes().items():
        proj = w.layers[0].proj[name]
        assert proj.shape == (fan_out, fan_in) and bool(proj.ne(0).all()) and torch.isfinite(proj).all()
    assert set(w.layers[0].bias) == {"q_proj", "k_proj", "v_proj", "o_proj"}  # Llama: attention_bias covers o_proj
    other = random_weights(cfg, device=torch.device("cpu"), dtype=torch.float32, seed=4)
    assert not torch.equal(w.layers[0].proj["q_proj"], other.layers[0].proj["q_proj"])


def test_unknown_load_format_is_refused_by_engine_and_config() -> None:
    with pytest.raises(ValueError, match="load_format"):
        EngineSpec(load_format="pickle")
    with pytest.raises(ConfigError, match="load_format"):
        ModelSettings(load_format="pickle")
    assert ModelSettings(load_format="dummy").load_format == "dummy"
