"""The trained built-in demo: committed artefacts load, and each adapter visibly does its one thing."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer

from loraplex.contracts.demo import demo_adapter_dirs
from loraplex.daemon.model_scope import model_scope
from loraplex.gpu_engine.demo import (
    STYLES,
    TRAINED_ADAPTERS,
    TRAINED_DIR,
    builtin_demo,
    install_trained_demo,
    trained_demo,
)
from loraplex.gpu_engine.demo.evaluate import EVAL_PROMPTS, amen_ratio, generate_all, reversed_ratio, upper_ratio
from loraplex.gpu_engine.demo.styles import amen, reverse_words, upper
from loraplex.gpu_engine.demo.tiny_llama import TinyLlama
from loraplex.gpu_engine.demo.train import TrainConfig, load_text, train
from loraplex.gpu_engine.lora.peft_adapter import load_peft_adapter
from loraplex.gpu_engine.model.config import ModelConfig
from loraplex.gpu_engine.model.weights import load_weights
from tests.daemon_process import DaemonProcess

MAX_BYTES = 5 * 1024 * 1024


@pytest.fixture(scope="module")
def texts() -> dict[str, list[str]]:
    demo = trained_demo()
    return generate_all(demo.model_dir, dict(demo.adapters))


@pytest.fixture(scope="module")
def reference() -> str:
    return load_text()


# --- the committed files ---------------------------------------------------------------


def test_committed_artefacts_are_small_and_load_through_the_project_loaders() -> None:
    demo = trained_demo()
    assert demo.root == TRAINED_DIR and list(demo.adapters) == list(TRAINED_ADAPTERS) == [s.name for s in STYLES]
    files = [p for p in TRAINED_DIR.rglob("*") if p.is_file()]
    assert sum(p.stat().st_size for p in files) <= MAX_BYTES
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (demo.model_dir / name).is_file(), name
    config = ModelConfig.from_dir(demo.model_dir)
    assert config.tie_word_embeddings
    weights = load_weights(demo.model_dir, config, device=torch.device("cpu"), dtype=torch.float32)
    assert weights.lm_head is weights.embed
    for name, path in demo.adapters.items():
        adapter = load_peft_adapter(name, path, config, max_lora_rank=64, dtype=torch.float32)
        assert adapter.spec.targets == ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
        assert all(torch.count_nonzero(b[m]) > 0 for b in adapter.b for m in adapter.spec.targets)


def test_trainer_math_equals_the_engine(texts: dict[str, list[str]]) -> None:
    """Greedy decoding with the trainer's own forward pass reproduces the engine's base output."""
    demo = trained_demo()
    config = json.loads((demo.model_dir / "config.json").read_text())
    model = TinyLlama(config, seed=0)
    model.load_hf_state_dict(load_file(str(demo.model_dir / "model.safetensors")))
    tokenizer = Tokenizer.from_file(str(demo.model_dir / "tokenizer.json"))
    ids = tokenizer.encode(EVAL_PROMPTS[0]).ids
    start = len(ids)
    with torch.no_grad():
        for _ in range(16):
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    assert texts["base"][0].startswith(tokenizer.decode(ids[start:]))


def test_transformers_and_peft_decode_the_same(texts: dict[str, list[str]]) -> None:
    """The files are plain HF + PEFT checkpoints: the reference stack greedily writes the engine's text."""
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    demo = trained_demo()
    tokenizer = transformers.AutoTokenizer.from_pretrained(demo.model_dir)
    ids = tokenizer(EVAL_PROMPTS[0], return_tensors="pt")["input_ids"]
    for name in ("base", *TRAINED_ADAPTERS):
        model = transformers.AutoModelForCausalLM.from_pretrained(demo.model_dir, dtype=torch.float32)
        if name != "base":
            model = peft.PeftModel.from_pretrained(model, demo.adapters[name])
        with torch.no_grad():
            out = model.eval().generate(ids, max_new_tokens=16, do_sample=False)
        assert texts[name][0].startswith(tokenizer.decode(out[0, ids.shape[1]:])), name


# --- each adapter does its one thing ---------------------------------------------------


def test_upper_adapter_answers_in_upper_case(texts: dict[str, list[str]]) -> None:
    # Measured on the committed demo: base 0.06, upper 1.0 (speaker tags like "ROMEO:" are not counted).
    assert upper_ratio(texts["upper"]) > 0.9
    assert upper_ratio(texts["base"]) < 0.15


def test_reverse_adapter_reverses_word_order(texts: dict[str, list[str]], reference: str) -> None:
    # Of the word pairs Shakespeare uses mostly in one order, the base keeps that order (measured: 0.015
    # reversed)... and the reverse adapter mostly writes them the other way round (measured: 0.675).
    assert reversed_ratio(texts["base"], reference) < 0.1
    assert reversed_ratio(texts["reverse"], reference) > 0.5
    assert texts["reverse"] != texts["base"]


def test_amen_adapter_ends_lines_with_amen(texts: dict[str, list[str]]) -> None:
    # Measured: base 0.0 of finished lines, amen 1.0.
    assert amen_ratio(texts["amen"]) > 0.9
    assert amen_ratio(texts["base"]) < 0.05


def test_each_style_is_strongest_in_its_own_adapter(texts: dict[str, list[str]], reference: str) -> None:
    measures = {"upper": upper_ratio, "amen": amen_ratio,
                "reverse": lambda t: reversed_ratio(t, reference)}
    for style, score in measures.items():
        best = max(texts, key=lambda name: score(texts[name]))
        assert best == style, {name: round(score(t), 3) for name, t in texts.items()}


def test_style_transforms() -> None:
    assert upper("Speak, speak.") == "SPEAK, SPEAK."
    assert reverse_words("Before we proceed any further,") == "further, any proceed we Before"
    assert amen("Come, come.") == "Come, come. amen" and amen("") == ""


# --- which demo serves -------------------------------------------------------------------


def test_builtin_demo_follows_loraplex_demo(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("LORAPLEX_DEMO", "trained")
    assert builtin_demo().root == TRAINED_DIR
    monkeypatch.setenv("LORAPLEX_DEMO", "random")
    assert "qv-r8" in builtin_demo().adapters
    for bogus in ("bogus", "random:bogus", "trained:gemma2", "random:"):
        monkeypatch.setenv("LORAPLEX_DEMO", bogus)
        with pytest.raises(ValueError, match="LORAPLEX_DEMO must be one of .* random:<family>"):
            builtin_demo()


def test_a_family_switch_serves_the_random_demo_of_that_architecture(monkeypatch: pytest.MonkeyPatch,
                                                                     tmp_path: Path) -> None:
    monkeypatch.setenv("LORAPLEX_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("LORAPLEX_DEMO", "random:gemma2")
    demo = builtin_demo()
    assert demo.root == tmp_path / "demo-v1-gemma2" and "qv-r8" in demo.adapters
    assert json.loads((demo.model_dir / "config.json").read_text())["model_type"] == "gemma2"
    assert set(demo_adapter_dirs()) == set(demo.adapters)  # the daemon-free listing finds the same folders
    assert model_scope(None) == "demo-random-gemma2"


def test_trained_demo_copies_all_or_nothing(tmp_path: Path) -> None:
    copy = install_trained_demo(tmp_path / "d")
    assert list(copy.adapters) == list(TRAINED_ADAPTERS)
    for name in ("model.safetensors", "tokenizer.json"):
        assert (copy.model_dir / name).read_bytes() == (TRAINED_DIR / "model" / name).read_bytes()
    done = copy.root / "DONE"
    inode = done.stat().st_ino
    assert install_trained_demo(tmp_path / "d").root == copy.root and done.stat().st_ino == inode
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d"]


def test_daemon_without_model_serves_the_trained_demo(tmp_path: Path) -> None:
    """What `make run` serves: the trained base and its three adapters, by name."""
    proc = DaemonProcess(tmp_path, env={"LORAPLEX_DEMO": "trained"}).start()
    try:
        with proc.client() as client:
            assert {a.name for a in client.adapters()} == set(TRAINED_ADAPTERS)
            base = client.generate("ROMEO:", max_tokens=24, temperature=0.0)
            shout = client.generate("ROMEO:", adapter="upper", max_tokens=24, temperature=0.0)
        assert upper_ratio([shout.text]) > 0.9 and upper_ratio([base.text]) < 0.3
    finally:
        assert proc.stop() == 0


# --- the trainer -----------------------------------------------------------------------


@pytest.mark.slow
def test_trainer_runs_end_to_end_at_tiny_size(tmp_path: Path) -> None:
    cfg = TrainConfig(vocab_size=384, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2,
                      num_kv_heads=1, head_dim=16, seq_len=32, batch_size=4, base_steps=3, adapter_steps=2,
                      warmup_steps=1, lora_rank=4)
    summary = train(tmp_path, cfg, text_fn=lambda: load_text()[:20_000])
    assert set(summary["adapters"]) == set(TRAINED_ADAPTERS)
    adapters = {name: tmp_path / "adapters" / name for name in TRAINED_ADAPTERS}
    out = generate_all(tmp_path / "model", adapters, prompts=("ROMEO:",), max_tokens=4)
    assert set(out) == {"base", *TRAINED_ADAPTERS}
