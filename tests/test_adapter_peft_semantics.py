"""Adapters as people publish them, built with peft itself on a tiny random Llama
(transformers' own config class): target_modules by suffix, full path, regex and
"all-linear", layers_to_transform + layers_pattern, rank_pattern + alpha_pattern,
fan_in_fan_out, odd ranks, rsLoRA and a pickled adapter_model.bin, served in one
mixed batch with a base row and compared with transformers + PEFT (greedy tokens
equal, chosen logprobs within 1e-3). Then the refusals: a .bin that is not a
tensor state dict, a pickle that would run code (it must not), an oversized .bin,
targets without tensors, tensors outside the targets, DoRA, modules_to_save.
"""
from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

import pytest
import torch

pytest.importorskip("peft")
pytest.importorskip("transformers")

from peft import LoraConfig, get_peft_model  # noqa: E402
from transformers import AutoModelForCausalLM, LlamaConfig  # noqa: E402

from loraplex import LLM, SamplingParams  # noqa: E402
from loraplex.daemon.adapter_hash import adapter_content_hash, adapter_fingerprint  # noqa: E402
from loraplex.errors import AdapterError  # noqa: E402
from loraplex.gpu_engine.lora.peft_adapter import load_peft_adapter  # noqa: E402
from loraplex.gpu_engine.model.config import ModelConfig  # noqa: E402
from loraplex.ipc.adapter_files import ADAPTER_BIN, MAX_WEIGHTS_BYTES, AdapterFileError  # noqa: E402
from tests.hf_reference import greedy  # noqa: E402
from tests.tolerances import forward_tolerance  # noqa: E402

NEW_TOKENS = 6
LAYERS = 3

# name -> (LoraConfig arguments, safetensors?)
CASES: dict[str, tuple[dict, bool]] = {
    "suffix": (dict(r=5, lora_alpha=10, target_modules=["self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj"]),
               True),
    "full-path": (dict(r=4, lora_alpha=8, target_modules=["model.layers.0.self_attn.k_proj",
                                                          "model.layers.2.mlp.up_proj"]), True),
    "regex": (dict(r=3, lora_alpha=6, target_modules=r".*\.layers\.[01]\.(self_attn\.(q|o)_proj|mlp\.gate_proj)"),
              True),
    "all-linear": (dict(r=4, lora_alpha=4, target_modules="all-linear", use_rslora=True), True),
    "layers": (dict(r=6, lora_alpha=12, target_modules=["q_proj", "up_proj"], layers_to_transform=[0, 2],
                    layers_pattern="layers"), True),
    "patterns": (dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"],
                      rank_pattern={"q_proj": 8, "model.layers.1.mlp.down_proj": 2},
                      alpha_pattern={"v_proj": 32, "layers.2.mlp.down_proj": 3}), True),
    "exclude": (dict(r=4, lora_alpha=16, target_modules=["q_proj", "k_proj"],
                     exclude_modules=["model.layers.1.self_attn.q_proj"]), True),
    "bin": (dict(r=7, lora_alpha=14, target_modules=["q_proj", "k_proj", "gate_proj"], use_rslora=True), False),
}


def _base(model_dir: Path):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)


def write_peft_adapter(model_dir: Path, dest: Path, seed: int, safe: bool = True, **lora) -> Path:
    """A LoRA adapter made by peft (random A and B: init_lora_weights=False) and saved by it."""
    torch.manual_seed(seed)
    model = get_peft_model(_base(model_dir), LoraConfig(init_lora_weights=False, **lora))
    model.save_pretrained(dest, safe_serialization=safe)
    return dest


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """A tiny random Llama (GQA) made by transformers; weights large enough that greedy is not a tie."""
    dest = tmp_path_factory.mktemp("peft-base")
    config = LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=LAYERS, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, vocab_size=512, max_position_embeddings=256,
                         initializer_range=0.2, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(3)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(dest)
    return dest


@pytest.fixture(scope="module")
def adapters(model_dir, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("peft-adapters")
    out = {name: write_peft_adapter(model_dir, root / name, 70 + i, safe, **lora)
           for i, (name, (lora, safe)) in enumerate(CASES.items())}
    # fan_in_fan_out on nn.Linear: peft warns and ignores it; so must we.
    fifo = write_peft_adapter(model_dir, root / "fan-in-fan-out", 90, r=4, lora_alpha=8, target_modules=["o_proj"])
    config = json.loads((fifo / "adapter_config.json").read_text())
    (fifo / "adapter_config.json").write_text(json.dumps(dict(config, fan_in_fan_out=True)))
    out["fan-in-fan-out"] = fifo
    return out


@pytest.fixture(scope="module")
def llm(model_dir) -> LLM:
    return LLM(model_dir, lora_backend="torch", page_tokens=4, num_pages=128, dtype="float32", max_lora_rank=16)


def test_peft_adapters_match_transformers_and_peft(llm, model_dir, adapters):
    assert (adapters["bin"] / ADAPTER_BIN).exists() and not (adapters["bin"] / "adapter_model.safetensors").exists()
    for name, path in adapters.items():
        llm.add_adapter(name, path)
    names = [*adapters, None]
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, 512, (int(n),), generator=g).tolist()
               for n in torch.randint(4, 14, (len(names),), generator=g)]
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=True)
    outs = llm.generate(prompts, adapters=names, sampling=params)
    base_tokens = greedy(model_dir, None, prompts[-1], NEW_TOKENS)[0]
    tol = forward_tolerance(llm.config)
    for name, prompt, got in zip(names, prompts, outs):
        tokens, logprobs = greedy(model_dir, adapters.get(name) if name else None, prompt, NEW_TOKENS)
        assert got.token_ids == tokens, f"adapter {name}: tokens differ from transformers + PEFT"
        worst = max(abs(a - b) for a, b in zip(got.logprobs, logprobs))
        assert worst < tol, f"adapter {name}: a logprob differs from transformers + PEFT by {worst}"
        if name is not None:  # the adapter changes the output (else equality above proves nothing)
            assert greedy(model_dir, None, prompt, NEW_TOKENS)[1] != logprobs, f"adapter {name} is a no-op"
    assert outs[-1].token_ids == base_tokens


def test_patterns_give_one_rank_and_zero_padding(model_dir, adapters):
    """rank_pattern: the adapter's rank is its largest; a module of smaller rank and a layer an
    adapter does not cover hold exact zeros beyond what the file holds."""
    cfg = ModelConfig.from_dir(model_dir)
    patterns = load_peft_adapter("p", adapters["patterns"], cfg, max_lora_rank=16, dtype=torch.float32)
    assert patterns.spec.rank == 8 and patterns.spec.targets == ("q_proj", "v_proj", "down_proj")
    assert patterns.a[1]["down_proj"][2:].abs().max() == 0 and patterns.a[1]["down_proj"][:2].abs().max() > 0
    layers = load_peft_adapter("l", adapters["layers"], cfg, max_lora_rank=16, dtype=torch.float32)
    assert layers.b[1]["q_proj"].abs().max() == 0 and layers.b[2]["q_proj"].abs().max() > 0
    with pytest.raises(AdapterError, match="max_lora_rank"):
        load_peft_adapter("p", adapters["patterns"], cfg, max_lora_rank=6, dtype=torch.float32)


def _edit_config(path: Path, **changes) -> None:
    config = json.loads((path / "adapter_config.json").read_text())
    (path / "adapter_config.json").write_text(json.dumps(dict(config, **changes)))


def _load(model_dir: Path, path: Path):
    return load_peft_adapter("x", path, ModelConfig.from_dir(model_dir), max_lora_rank=16, dtype=torch.float32)


def test_targets_and_tensors_must_agree(model_dir, tmp_path):
    path = write_peft_adapter(model_dir, tmp_path / "qv", 5, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    _edit_config(path, target_modules=["q_proj", "v_proj", "k_proj"])
    with pytest.raises(AdapterError, match=r"does not hold, e.g. model\.layers\.0\.self_attn\.k_proj\.lora_A"):
        _load(model_dir, path)
    _edit_config(path, target_modules=["q_proj"])
    with pytest.raises(AdapterError, match=r"v_proj.*does not select"):
        _load(model_dir, path)
    _edit_config(path, target_modules=["q_proj", "v_proj"], layers_to_transform=1)
    with pytest.raises(AdapterError, match=r"layers\.0\.self_attn\.q_proj.*does not select"):
        _load(model_dir, path)
    _edit_config(path, target_modules=["nothing_here"], layers_to_transform=None)
    with pytest.raises(AdapterError, match="match no projection"):
        _load(model_dir, path)
    _edit_config(path, target_modules="(.*)*q_proj")
    with pytest.raises(AdapterError, match="nests quantifiers"):
        _load(model_dir, path)


def test_trained_extras_are_refused_with_what_to_do(model_dir, tmp_path):
    """(LoRA on lm_head is served: tests/test_head_lora.py.)"""
    path = write_peft_adapter(model_dir, tmp_path / "dora", 7, r=4, lora_alpha=8, target_modules=["q_proj"],
                              use_dora=True)
    with pytest.raises(AdapterError, match="DoRA.*merge_and_unload"):
        _load(model_dir, path)
    path = write_peft_adapter(model_dir, tmp_path / "mts", 8, r=4, lora_alpha=8, target_modules=["q_proj"],
                              modules_to_save=["lm_head"])
    with pytest.raises(AdapterError, match="modules_to_save.*merge_and_unload.*retrain without modules_to_save"):
        _load(model_dir, path)


def _bin_adapter(model_dir: Path, dest: Path) -> Path:
    return write_peft_adapter(model_dir, dest, 9, safe=False, r=4, lora_alpha=8, target_modules=["q_proj"])


class _WouldRunCode:
    """Unpickled freely, this creates `marker` (an attacker's code would do worse)."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.mark.parametrize("fmt", ["zip", "legacy-pickle"])
def test_a_pickle_that_would_run_code_is_refused_without_running_it(model_dir, tmp_path, fmt):
    path = _bin_adapter(model_dir, tmp_path / "evil")
    marker = tmp_path / "pwned"
    evil = {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": _WouldRunCode(str(marker))}
    if fmt == "zip":
        torch.save(evil, path / ADAPTER_BIN)
    else:
        (path / ADAPTER_BIN).write_bytes(pickle.dumps(evil))
    with pytest.raises(AdapterError, match="restricted"):
        _load(model_dir, path)
    assert not marker.exists(), "loading the adapter ran code from its pickle"


def test_a_bin_of_non_tensors_or_non_finite_values_is_refused(model_dir, tmp_path):
    path = _bin_adapter(model_dir, tmp_path / "odd")
    good = torch.load(path / ADAPTER_BIN, weights_only=True)
    key = next(iter(good))
    torch.save(dict(good, **{key: [1.0, 2.0]}), path / ADAPTER_BIN)
    with pytest.raises(AdapterError, match="is a list, not a tensor"):
        _load(model_dir, path)
    torch.save(dict(good, **{key: good[key].to(torch.int64) + 1}), path / ADAPTER_BIN)
    with pytest.raises(AdapterError, match="floating point"):
        _load(model_dir, path)
    bad = good[key].clone()
    bad[0, 0] = float("nan")
    torch.save(dict(good, **{key: bad}), path / ADAPTER_BIN)
    with pytest.raises(AdapterError, match="non-finite"):
        _load(model_dir, path)
    torch.save(dict(good, **{key: good[key][:, :-1].clone()}), path / ADAPTER_BIN)
    with pytest.raises(AdapterError, match="shape"):
        _load(model_dir, path)


def test_an_oversized_bin_is_refused_before_reading_and_the_daemon_hashes_a_bin(model_dir, tmp_path):
    path = _bin_adapter(model_dir, tmp_path / "big")
    assert adapter_content_hash(path)  # the daemon's pre-check (size and allow-list) takes a .bin
    assert [name for name, _, _ in adapter_fingerprint(path)] == ["adapter_config.json", ADAPTER_BIN]
    with open(path / ADAPTER_BIN, "r+b") as f:
        f.truncate(MAX_WEIGHTS_BYTES + 1)  # sparse: nothing is written, nothing may be read
    with pytest.raises(AdapterError, match=f"at most {MAX_WEIGHTS_BYTES}"):
        _load(model_dir, path)
    with pytest.raises(AdapterFileError, match=f"at most {MAX_WEIGHTS_BYTES}"):
        adapter_content_hash(path)
    os.unlink(path / ADAPTER_BIN)


def test_a_legacy_non_zip_bin_loads_the_same_weights(model_dir, tmp_path):
    """torch.save's pre-1.6 format cannot be memory-mapped: it is read (still restricted) instead."""
    path = _bin_adapter(model_dir, tmp_path / "legacy")
    zipped = _load(model_dir, path)
    tensors = torch.load(path / ADAPTER_BIN, weights_only=True)
    torch.save(tensors, path / ADAPTER_BIN, _use_new_zipfile_serialization=False)
    assert (path / ADAPTER_BIN).read_bytes()[:4] != b"PK\x03\x04"
    legacy = _load(model_dir, path)
    assert all(torch.equal(legacy.a[i]["q_proj"], zipped.a[i]["q_proj"]) for i in range(LAYERS))


def test_safetensors_is_preferred_when_both_exist(model_dir, tmp_path):
    path = write_peft_adapter(model_dir, tmp_path / "both", 12, r=4, lora_alpha=8, target_modules=["q_proj"])
    (path / ADAPTER_BIN).write_bytes(pickle.dumps({"not": "read"}))
    adapter = _load(model_dir, path)
    assert adapter.a[0]["q_proj"].abs().max() > 0


def test_old_saves_with_an_adapter_name_in_the_keys_load_the_same(model_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    path = write_peft_adapter(model_dir, tmp_path / "old", 13, r=4, lora_alpha=8, target_modules=["v_proj"])
    new = _load(model_dir, path)
    tensors = load_file(str(path / "adapter_model.safetensors"))
    save_file({k.replace(".weight", ".default.weight"): t for k, t in tensors.items()},
              str(path / "adapter_model.safetensors"))
    old = _load(model_dir, path)
    assert all(torch.equal(old.b[i]["v_proj"], new.b[i]["v_proj"]) for i in range(LAYERS))


@pytest.mark.slow
def test_through_a_daemon_a_bin_serves_as_its_safetensors_and_a_code_pickle_is_a_typed_error(demo, tmp_path):
    """The daemon only hashes a .bin (torch-free); the cache manager loads it restricted. A pickle that
    would run code reaches the client as invalid_adapter, and its code never runs."""
    from loraplex.ipc.client import AdminClient, LoraplexError
    from tests import adversarial_adapters as adv
    from tests.daemon_process import DaemonProcess

    allowed = tmp_path / "adapters"
    adv.valid(demo.adapters["qv-r8"], allowed / "st")
    adv.as_bin(demo.adapters["qv-r8"], allowed / "bin")
    evil = adv.as_bin(demo.adapters["qv-r8"], allowed / "evil")
    marker = tmp_path / "pwned"
    torch.save({"x": _WouldRunCode(str(marker))}, evil / ADAPTER_BIN)
    proc = DaemonProcess(tmp_path, "--model", str(demo.model_dir),
                         env={"LORAPLEX_SERVER_ADAPTER_DIRS": str(allowed)}).start(timeout_s=120)
    try:
        with AdminClient(runtime_dir=proc.runtime_dir) as admin:
            admin.add_adapter("st", allowed / "st", timeout=60)
            admin.add_adapter("bin", allowed / "bin", timeout=60)
            with pytest.raises(LoraplexError) as err:
                admin.add_adapter("evil", evil, timeout=60)
        assert err.value.code.value == "invalid_adapter" and "restricted" in str(err.value), str(err.value)
        assert not marker.exists(), "the daemon ran code from an adapter's pickle"
        with proc.client() as client:
            outs = [client.generate([5, 9, 17, 3, 44], adapter=name, max_tokens=6, temperature=0.0,
                                    ignore_eos=True, logprobs=True, timeout=60) for name in ("st", "bin", None)]
        assert outs[0].token_ids == outs[1].token_ids and outs[0].logprobs == outs[1].logprobs
        assert outs[0].logprobs != outs[2].logprobs  # the adapter is applied
    finally:
        assert proc.stop() == 0, proc.log()


def test_a_gpt2_conv1d_adapter_with_fan_in_fan_out_loads_as_peft_holds_it(tmp_path):
    """GPT-2's Conv1D bases (fan_in_fan_out, fused c_attn, "all-linear" saved as full paths): A is
    [r, in] and B [out, r] as peft holds them; the engine names come from the family's module_paths."""
    from transformers import GPT2Config

    config = GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=512, n_positions=128, bos_token_id=1,
                        eos_token_id=2)
    torch.manual_seed(4)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "gpt2")
    cfg = ModelConfig.from_dir(tmp_path / "gpt2")
    for targets in (["c_attn", "c_fc"], "all-linear"):
        torch.manual_seed(5)
        peft_model = get_peft_model(AutoModelForCausalLM.from_pretrained(tmp_path / "gpt2"),
                                    LoraConfig(r=4, lora_alpha=8, target_modules=targets, fan_in_fan_out=True,
                                               init_lora_weights=False))
        peft_model.save_pretrained(tmp_path / "ad")
        adapter = load_peft_adapter("g", tmp_path / "ad", cfg, max_lora_rank=16, dtype=torch.float32)
        paths = cfg.module_paths()
        for name in adapter.spec.targets:
            lora = peft_model.get_submodule(f"base_model.model.{cfg.layer_prefix}.1.{paths[name]}")
            assert torch.equal(adapter.a[1][name], lora.lora_A["default"].weight.detach())
            assert torch.equal(adapter.b[1][name], lora.lora_B["default"].weight.detach())
        assert len(adapter.spec.targets) == (2 if isinstance(targets, list) else len(paths))
