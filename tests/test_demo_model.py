"""The built-in demo model: determinism, install semantics, and HF/PEFT compatibility."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from loraplex.cli import main as cli_main
from loraplex.gpu_engine.demo import (
    DEMO_ADAPTERS,
    build_demo_tokenizer,
    default_demo_dir,
    demo_model_config,
    ensure_demo_model,
    llama_config,
    mistral_config,
    qwen2_config,
    write_random_adapter,
    write_random_checkpoint,
)
from tests.tolerances import forward_tolerance

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

PROMPT = "The river that runs through the valley is wide and slow in summer."
ROUND_TRIP_TEXTS = [
    "",
    "Hello, world!",
    "  leading and trailing spaces  ",
    "tabs\tand\nnew\r\nlines\n\n",
    "ünïcødé, 日本語, emoji 🙂👍🏽, math ∑∫√",
    "code: def f(x):\n    return x ** 2  # square",
    "zzzqqq xylophone QUIXOTIC 1234567890 !@#$%^&*()",
]


def _digests(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory):
    return ensure_demo_model(tmp_path_factory.mktemp("demo") / "demo-v1")


@pytest.fixture(scope="module")
def prompt_ids(demo) -> torch.Tensor:
    tok = transformers.AutoTokenizer.from_pretrained(demo.model_dir)
    return torch.tensor([tok(PROMPT)["input_ids"]])


def _load_model(path: Path):
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def base_logits(demo, prompt_ids) -> torch.Tensor:
    with torch.no_grad():
        return _load_model(demo.model_dir)(prompt_ids).logits[0]  # [tokens, vocab]


# --- install semantics ---------------------------------------------------------


def test_two_fresh_writes_are_byte_identical(tmp_path: Path, demo) -> None:
    other = ensure_demo_model(tmp_path / "again")
    first, second = _digests(demo.root), _digests(other.root)
    assert "model/model.safetensors" in first and "DONE" in first
    assert first == second


def test_layout_matches_description(demo) -> None:
    assert demo.model_dir == demo.root / "model"
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "special_tokens_map.json", "generation_config.json"):
        assert (demo.model_dir / name).is_file(), name
    assert list(demo.adapters) == [spec.name for spec in DEMO_ADAPTERS]
    assert {"qv-r8", "attn-r16", "all-r32", "mlp-r64", "rslora-r16", "kdown-r8"} <= set(demo.adapters)
    for path in demo.adapters.values():
        assert (path / "adapter_config.json").is_file() and (path / "adapter_model.safetensors").is_file()
    assert not list(demo.root.parent.glob(".*tmp-*")), "temporary dir left behind"


def test_existing_demo_is_reused_and_force_rewrites(tmp_path: Path) -> None:
    root = tmp_path / "d"
    ensure_demo_model(root)
    done = root / "DONE"
    before = done.stat()
    ensure_demo_model(root)
    assert done.stat().st_mtime_ns == before.st_mtime_ns and done.stat().st_ino == before.st_ino
    digests = _digests(root)
    ensure_demo_model(root, force=True)
    assert done.stat().st_ino != before.st_ino
    assert _digests(root) == digests
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d"]


def test_stale_version_is_replaced_but_foreign_dir_is_refused(tmp_path: Path) -> None:
    stale = tmp_path / "stale"
    stale.mkdir()
    (stale / "DONE").write_text("loraplex-demo-v0\n")
    (stale / "junk").write_text("old")
    ensure_demo_model(stale)
    assert not (stale / "junk").exists() and (stale / "model" / "config.json").is_file()

    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "precious.txt").write_text("keep me")
    with pytest.raises(FileExistsError):
        ensure_demo_model(foreign)
    with pytest.raises(FileExistsError):
        ensure_demo_model(foreign, force=True)
    assert (foreign / "precious.txt").read_text() == "keep me"

    empty = tmp_path / "empty"
    empty.mkdir()
    ensure_demo_model(empty)
    assert (empty / "DONE").is_file()


def test_default_demo_dir_follows_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("LORAPLEX_CACHE_DIR", str(tmp_path / "lp"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_demo_dir() == tmp_path / "lp" / "demo-v1"
    monkeypatch.delenv("LORAPLEX_CACHE_DIR")
    assert default_demo_dir() == tmp_path / "xdg" / "loraplex" / "demo-v1"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_demo_dir() == tmp_path / "home" / ".cache" / "loraplex" / "demo-v1"


def test_cli_demo_model_writes_once(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "d"
    assert cli_main(["demo-model", str(root)]) == 0
    out = capsys.readouterr().out
    assert f"model\t{root / 'model'}" in out
    for spec in DEMO_ADAPTERS:
        assert f"adapter\t{spec.name}\t{root / 'adapters' / spec.name}" in out
    weights = root / "model" / "model.safetensors"
    mtime = weights.stat().st_mtime_ns
    assert cli_main(["demo-model", str(root)]) == 0
    assert weights.stat().st_mtime_ns == mtime

    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "x").write_text("x")
    assert cli_main(["demo-model", str(foreign)]) == 1
    assert "refusing" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli_main(["no-such-command"])


# --- tokenizer -------------------------------------------------------------------


def test_tokenizer_is_deterministic_and_round_trips(demo) -> None:
    tok = build_demo_tokenizer()
    assert tok.to_str() == build_demo_tokenizer().to_str()
    assert tok.get_vocab_size() == demo_model_config()["vocab_size"] == 512
    assert [tok.token_to_id(t) for t in ("<unk>", "<s>", "</s>")] == [0, 1, 2]
    for text in ROUND_TRIP_TEXTS:
        assert tok.decode(tok.encode(text).ids) == text

    hf = transformers.AutoTokenizer.from_pretrained(demo.model_dir)
    assert (hf.bos_token_id, hf.eos_token_id, hf.unk_token_id) == (1, 2, 0)
    for text in ROUND_TRIP_TEXTS:
        ids = hf(text)["input_ids"]
        assert ids == tok.encode(text).ids
        assert hf.decode(ids) == text
    # Common English compresses well below one token per byte.
    assert len(hf(PROMPT)["input_ids"]) < len(PROMPT) / 2


# --- base checkpoints in transformers -------------------------------------------


def test_transformers_loads_demo_with_peaked_finite_logits(demo, base_logits: torch.Tensor) -> None:
    config = json.loads((demo.model_dir / "config.json").read_text())
    assert config == demo_model_config()
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (8, 4, 32)
    assert torch.isfinite(base_logits).all()
    std = base_logits.std(dim=-1)
    assert ((std > 2.5) & (std < 6.0)).all(), std
    # The model must actually use its context: different positions predict differently.
    assert base_logits.argmax(-1).unique().numel() > base_logits.shape[0] // 2


def test_sharded_checkpoint_equals_single_file(tmp_path: Path) -> None:
    config = llama_config()
    write_random_checkpoint(tmp_path / "one", config, seed=7)
    write_random_checkpoint(tmp_path / "three", config, seed=7, num_shards=3)
    index = json.loads((tmp_path / "three" / "model.safetensors.index.json").read_text())
    shard_names = [f"model-0000{k}-of-00003.safetensors" for k in (1, 2, 3)]
    assert sorted(set(index["weight_map"].values())) == shard_names
    merged: dict[str, torch.Tensor] = {}
    for name in shard_names:
        merged.update(load_file(tmp_path / "three" / name))
    single = load_file(tmp_path / "one" / "model.safetensors")
    assert set(merged) == set(single) == set(index["weight_map"])
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in single.values())
    for name, tensor in single.items():
        assert torch.equal(merged[name], tensor), name

    one, three = _load_model(tmp_path / "one"), _load_model(tmp_path / "three")
    assert set(one.state_dict()) == set(three.state_dict())
    for name, tensor in one.state_dict().items():
        assert torch.equal(three.state_dict()[name], tensor), name
        if name in single:
            assert torch.equal(single[name], tensor), name


def test_seed_changes_weights_and_nothing_is_zero(tmp_path: Path) -> None:
    config = llama_config(attention_bias=True, mlp_bias=True)
    write_random_checkpoint(tmp_path / "a", config, seed=1)
    write_random_checkpoint(tmp_path / "b", config, seed=2)
    a, b = load_file(tmp_path / "a" / "model.safetensors"), load_file(tmp_path / "b" / "model.safetensors")
    assert "model.layers.1.mlp.down_proj.bias" in a and "model.layers.0.self_attn.o_proj.bias" in a
    for name, tensor in a.items():
        assert (tensor != 0).all(), name
        assert not torch.equal(tensor, b[name]), name


@pytest.mark.parametrize(
    "config",
    [
        qwen2_config(),
        mistral_config(),
        llama_config(attention_bias=True, mlp_bias=True, tie_word_embeddings=True),
        llama_config(head_dim=None, num_key_value_heads=4),
    ],
    ids=["qwen2", "mistral", "llama-bias-tied", "llama-mha"],
)
def test_architectures_load_in_transformers(tmp_path: Path, config: dict) -> None:
    write_random_checkpoint(tmp_path, config, seed=3)
    written = load_file(tmp_path / "model.safetensors")
    if config["model_type"] == "qwen2":
        assert "model.layers.0.self_attn.q_proj.bias" in written
        assert "model.layers.0.self_attn.o_proj.bias" not in written
    assert ("lm_head.weight" in written) != bool(config["tie_word_embeddings"])
    model = _load_model(tmp_path)
    assert type(model).__name__ == config["architectures"][0]
    state = model.state_dict()
    for name, tensor in written.items():
        assert torch.equal(state[name], tensor), name
    with torch.no_grad():
        logits = model(torch.tensor([[1, 5, 9, 200, 7]])).logits
    assert logits.shape == (1, 5, config["vocab_size"]) and torch.isfinite(logits).all()


def test_bad_shard_count_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        write_random_checkpoint(tmp_path, llama_config(), seed=0, num_shards=0)
    with pytest.raises(ValueError):
        write_random_checkpoint(tmp_path, llama_config(), seed=0, num_shards=10_000)
    with pytest.raises(ValueError):
        write_random_checkpoint(tmp_path, llama_config(model_type="mamba"), seed=0)


# --- adapters ----------------------------------------------------------------------


def test_adapter_files_follow_peft_layout(tmp_path: Path) -> None:
    config = llama_config()
    write_random_adapter(
        tmp_path, config, rank=4, alpha=8, target_modules=["v_proj", "down_proj"], seed=0,
        extra_config={"lora_dropout": 0.5},
    )
    adapter_config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert adapter_config["peft_type"] == "LORA" and adapter_config["task_type"] == "CAUSAL_LM"
    assert adapter_config["target_modules"] == ["down_proj", "v_proj"]
    assert (adapter_config["r"], adapter_config["lora_alpha"], adapter_config["lora_dropout"]) == (4, 8, 0.5)
    tensors = load_file(tmp_path / "adapter_model.safetensors")
    assert len(tensors) == config["num_hidden_layers"] * 2 * 2
    prefix = "base_model.model.model.layers.1"
    assert tensors[f"{prefix}.self_attn.v_proj.lora_A.weight"].shape == (4, 64)
    assert tensors[f"{prefix}.self_attn.v_proj.lora_B.weight"].shape == (2 * 16, 4)
    assert tensors[f"{prefix}.mlp.down_proj.lora_A.weight"].shape == (4, 176)
    assert tensors[f"{prefix}.mlp.down_proj.lora_B.weight"].shape == (64, 4)
    assert all((t != 0).all() for t in tensors.values())
    with pytest.raises(ValueError):
        write_random_adapter(tmp_path / "bad", config, rank=4, alpha=8, target_modules=["lm_head"], seed=0)


def _adapter_logits(demo, name: str, prompt_ids: torch.Tensor) -> torch.Tensor:
    model = peft.PeftModel.from_pretrained(_load_model(demo.model_dir), demo.adapters[name]).eval()
    with torch.no_grad():
        return model(prompt_ids).logits[0]


def test_every_demo_adapter_loads_in_peft_and_changes_logits(demo, prompt_ids, base_logits) -> None:
    results = {name: _adapter_logits(demo, name, prompt_ids) for name in demo.adapters}
    for name, logits in results.items():
        assert torch.isfinite(logits).all(), name
        relative = ((logits - base_logits).norm() / base_logits.norm()).item()
        # Visible but not dominant: the base model still shapes the output.
        assert 0.05 < relative < 1.0, (name, relative)
        # Different greedy choices at some positions, so adapters decode differently.
        assert (logits.argmax(-1) != base_logits.argmax(-1)).any(), name
    names = list(results)
    for i, first in enumerate(names):
        for second in names[i + 1:]:
            assert (results[first].argmax(-1) != results[second].argmax(-1)).any(), (first, second)


@pytest.mark.parametrize("family", ["gemma2", "gpt2"] + [pytest.param(f, marks=pytest.mark.slow) for f in (
    "qwen3", "gemma", "gemma3_text", "phi3", "phi")])
def test_random_checkpoint_of_every_family_matches_transformers_and_peft(tmp_path, family) -> None:
    """The demo writer's checkpoint and adapter of each family load in transformers + PEFT under the
    family's own classes, decode non-degenerately, and the engine gives the same greedy tokens."""
    from loraplex import LLM, SamplingParams
    from loraplex.gpu_engine.demo import family_config
    from loraplex.gpu_engine.demo.model import family_targets
    from tests.hf_reference import greedy

    config = family_config(family)
    write_random_checkpoint(tmp_path / "model", config, seed=5)
    targets = family_targets(config, ("q_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"))
    write_random_adapter(tmp_path / "a", config, rank=5, alpha=10.0, target_modules=targets, seed=6)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "model")
    assert hf.config.model_type == family
    llm = LLM(tmp_path / "model", page_tokens=8, num_pages=64)
    llm.add_adapter("a", tmp_path / "a")
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (40, 13)]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=True)
    seen: set[int] = set()
    for name in (None, "a"):
        for prompt, out in zip(prompts, llm.generate(prompts, adapters=name, sampling=params)):
            tokens, logprobs = greedy(tmp_path / "model", None if name is None else tmp_path / "a", prompt, 8)
            assert out.token_ids == tokens, (family, name)
            assert max(abs(a - b) for a, b in zip(out.logprobs, logprobs)) < forward_tolerance(llm.config)
            seen.update(tokens)
    assert len(seen) > 6, f"{family}: degenerate random model ({len(seen)} distinct tokens)"


@pytest.mark.slow
def test_random_demo_per_family_serves(tmp_path) -> None:
    from loraplex import LLM, SamplingParams

    demo = ensure_demo_model(tmp_path / "demo-gemma2", family="gemma2")
    llm = LLM(demo.model_dir, num_pages=128)
    for name, path in demo.adapters.items():
        llm.add_adapter(name, path)
    outs = llm.generate([[5, 6, 7, 8]] * len(demo.adapters), adapters=list(demo.adapters),
                        sampling=SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    assert all(len(o.token_ids) == 4 for o in outs)
    with pytest.raises(ValueError, match="family"):
        ensure_demo_model(tmp_path / "x", family="mamba")
