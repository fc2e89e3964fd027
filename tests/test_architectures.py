"""Every served architecture equals transformers + PEFT: a tiny random checkpoint built by
transformers' own config class and save_pretrained, adapters built by peft (random lora_B, odd
ranks, rsLoRA, MLP targets named as the family names them), one mixed batch with base-only rows,
prompts past the sliding window where there is one, soft-caps active; greedy tokens equal and
chosen-token logprobs within 1e-3 (float32). Also: merged mode, tensor parallelism (slow), the
Triton interpreter (slow), a daemon with CPU workers (slow), checkpoint layouts (Gemma 3's vision
tower, GPT-2's bare keys), and the refused families' errors.
"""
from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest
import torch

from loraplex import LLM, SamplingParams
from loraplex.gpu_engine.model.config import ModelConfig, UnsupportedModelError
from tests.hf_reference import greedy
from tests.tolerances import forward_tolerance

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

NEW_TOKENS = 12
TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2)


def _randomize(model, *, one_plus: bool) -> None:
    """Weights that give peaked, prompt-dependent logits (HF's 0.02 init gives near-uniform ones):
    projections std 1/sqrt(fan_in), norms near 1 (near 0 where the norm is 1 + w), LM head so that
    logits have std ~4. A tied embedding is kept small beside the layers' outputs (else the last
    input token dominates the residual and greedy repeats it) and the final norm's gain makes up."""
    from transformers.pytorch_utils import Conv1D

    gen = torch.Generator().manual_seed(1234)

    def fill(t: torch.Tensor, std: float, mean: float = 0.0) -> None:
        t.copy_(torch.randn(t.shape, generator=gen) * std + mean)

    head = model.get_output_embeddings()
    text = model.config.get_text_config()
    hidden = text.hidden_size
    tied = bool(getattr(text, "tie_word_embeddings", False) or getattr(model.config, "tie_word_embeddings", False))
    embed_std = 0.3 / (math.sqrt(hidden) if one_plus else 1.0) if tied else 1.0
    final_gain = 4.0 / (math.sqrt(hidden) * embed_std) if tied else 1.0
    final_norms = ("model.norm.weight", "transformer.ln_f.weight", "model.final_layernorm.weight",
                   "model.language_model.norm.weight")
    with torch.no_grad():
        for name, module in model.named_modules():
            if module is head:
                if not tied:
                    fill(module.weight, 4.0 / math.sqrt(hidden))
                if getattr(module, "bias", None) is not None:
                    fill(module.bias, 0.1)
            elif isinstance(module, torch.nn.Linear):
                fill(module.weight, module.in_features ** -0.5)
                if module.bias is not None:
                    fill(module.bias, 0.1)
            elif isinstance(module, Conv1D):
                fill(module.weight, module.weight.shape[0] ** -0.5)
                fill(module.bias, 0.1)
            elif isinstance(module, torch.nn.Embedding):
                fill(module.weight, 0.3 if "wpe" in name else embed_std)
        for name, p in model.named_parameters():
            if name in final_norms:
                fill(p, 0.1, final_gain - (1.0 if one_plus else 0.0))
            elif p.dim() == 1 and ("norm" in name or ".ln_" in name) and name.endswith("weight"):
                fill(p, 0.1, 0.0 if one_plus else 1.0)
            elif p.dim() == 1 and ("norm" in name or ".ln_" in name) and name.endswith("bias"):
                fill(p, 0.1)


def _build(root: Path, config, adapters: dict[str, dict], *, one_plus: bool = False,
           model_cls=None) -> tuple[Path, dict[str, Path]]:
    torch.manual_seed(0)
    cls = model_cls or transformers.AutoModelForCausalLM
    model = (cls(config) if model_cls else cls.from_config(config)).to(torch.float32).eval()
    _randomize(model, one_plus=one_plus)
    model_dir = root / "model"
    model.save_pretrained(model_dir, safe_serialization=True)
    out = {}
    for i, (name, kwargs) in enumerate(adapters.items()):
        torch.manual_seed(100 + i)
        lora = peft.LoraConfig(init_lora_weights=False, lora_dropout=0.0, **kwargs)
        peft.get_peft_model(copy.deepcopy(model), lora).save_pretrained(root / name)
        out[name] = root / name
    return model_dir, out


def _prompts(seed: int, lengths: list[int], vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def _check(model_dir: Path, adapters: dict[str, Path], lengths: list[int], names: list[str | None]) -> None:
    llm = LLM(model_dir, page_tokens=8, num_pages=256)
    for name, path in adapters.items():
        llm.add_adapter(name, path)
    prompts = _prompts(len(lengths), lengths, llm.config.vocab_size)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=True)
    outs = llm.generate(prompts, adapters=names, sampling=params)
    seen: set[int] = set()
    tol = forward_tolerance(llm.config)
    for prompt, name, out in zip(prompts, names, outs):
        ref_tokens, ref_logprobs = greedy(model_dir, adapters.get(name), prompt, NEW_TOKENS)
        seen.update(ref_tokens)
        assert out.token_ids == ref_tokens, f"adapter {name}: tokens differ"
        worst = max(abs(a - b) for a, b in zip(out.logprobs, ref_logprobs))
        assert worst < tol, f"adapter {name}: logprob error {worst} over {tol:.2g}"
    # a model that repeats each prompt's last token (the failure of badly scaled random weights) gives
    # about one distinct token per prompt
    assert len(seen) > len(prompts) + 3, f"degenerate reference: only {len(seen)} distinct greedy tokens"


LLAMA_TARGETS = {
    "qv3": dict(r=3, lora_alpha=6, target_modules=["q_proj", "v_proj"]),
    "all5": dict(r=5, lora_alpha=4, use_rslora=True,
                 target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
    "mlp7": dict(r=7, lora_alpha=7, target_modules=["gate_proj", "up_proj", "down_proj"]),
}
NAMES = ["qv3", None, "all5", "mlp7", None]


def _qwen3(root: Path):
    config = transformers.Qwen3Config(**TINY, head_dim=24, tie_word_embeddings=False, rms_norm_eps=1e-6)
    return _build(root, config, LLAMA_TARGETS)


def _gemma2(root: Path):
    config = transformers.Gemma2Config(**{**TINY, "num_hidden_layers": 3}, head_dim=16, sliding_window=12,
                                       attn_logit_softcapping=3.0, final_logit_softcapping=6.0,
                                       query_pre_attn_scalar=24, attn_implementation="eager")
    return _build(root, config, LLAMA_TARGETS, one_plus=True)


def _phi3(root: Path):
    rope_dim = 12  # head_dim 16 times partial_rotary_factor 0.75
    g = torch.Generator().manual_seed(3)
    short = (1.0 + torch.rand(rope_dim // 2, generator=g)).tolist()
    long = (2.0 + 4 * torch.rand(rope_dim // 2, generator=g)).tolist()
    config = transformers.Phi3Config(
        **TINY, max_position_embeddings=128, original_max_position_embeddings=32, pad_token_id=0,
        bos_token_id=1, eos_token_id=2, partial_rotary_factor=0.75,
        rope_scaling={"rope_type": "longrope", "short_factor": short, "long_factor": long})
    adapters = {"qkv3": dict(r=3, lora_alpha=6, target_modules=["qkv_proj", "o_proj"]),
                "all5": dict(r=5, lora_alpha=4, use_rslora=True,
                             target_modules=["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]),
                "mlp7": dict(r=7, lora_alpha=7, target_modules=["gate_up_proj", "down_proj"])}
    return _build(root, config, adapters)


def test_qwen3(tmp_path):
    model_dir, adapters = _qwen3(tmp_path)
    cfg = ModelConfig.from_dir(model_dir)
    assert cfg.qk_norm and cfg.head_dim == 24 and not cfg.qkv_bias
    _check(model_dir, adapters, [30, 7, 41, 19, 25], NAMES)


def test_gemma2_softcap_sliding(tmp_path):
    model_dir, adapters = _gemma2(tmp_path)
    cfg = ModelConfig.from_dir(model_dir)
    assert cfg.layer_windows == (12, None, 12) and cfg.attn_softcap == 3.0 and cfg.final_softcap == 6.0
    _check(model_dir, adapters, [40, 9, 33, 26, 18], NAMES)


def test_gemma3_text_local_rope(tmp_path):
    config = transformers.Gemma3TextConfig(
        **{**TINY, "num_hidden_layers": 3}, head_dim=16, sliding_window=10, layer_types=[
            "sliding_attention", "full_attention", "sliding_attention"], query_pre_attn_scalar=16,
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 100000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 500.0}})
    model_dir, adapters = _build(tmp_path, config, LLAMA_TARGETS, one_plus=True)
    cfg = ModelConfig.from_dir(model_dir)
    assert cfg.qk_norm and cfg.local_rope_theta == 500.0 and cfg.rope_scaling.rope_type == "linear"
    _check(model_dir, adapters, [35, 8, 22, 31, 14], NAMES)


def test_gemma3_multimodal_language_model(tmp_path):
    text = transformers.Gemma3TextConfig(**TINY, head_dim=16, sliding_window=10,
                                         layer_types=["sliding_attention", "full_attention"])
    vision = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                             num_attention_heads=2, image_size=28, patch_size=14)
    config = transformers.Gemma3Config(text_config=text.to_dict(), vision_config=vision.to_dict(),
                                       mm_tokens_per_image=4)
    adapters = {"lm5": dict(r=5, lora_alpha=5, target_modules=r".*language_model.*\.(q_proj|v_proj|down_proj)")}
    model_dir, adapters = _build(tmp_path, config, adapters, one_plus=True,
                                 model_cls=transformers.Gemma3ForConditionalGeneration)
    cfg = ModelConfig.from_dir(model_dir)
    assert cfg.model_type == "gemma3_text" and cfg.layer_prefix == "model.language_model.layers"
    _check(model_dir, adapters, [24, 13, 30], ["lm5", None, "lm5"])


def test_phi3_fused_longrope(tmp_path):
    model_dir, adapters = _phi3(tmp_path)
    rope_dim = 12
    cfg = ModelConfig.from_dir(model_dir)
    assert cfg.rope_scaling.rope_type == "longrope" and cfg.rope_dim == rope_dim
    # a prompt past the original 32 positions (long factors from its prefill), one crossing while decoding
    _check(model_dir, adapters, [40, 9, 25, 28, 12], ["qkv3", None, "all5", "mlp7", None])


def test_gpt2_conv1d(tmp_path):
    config = transformers.GPT2Config(vocab_size=512, n_embd=64, n_layer=2, n_head=4, n_positions=128)
    adapters = {"attn3": dict(r=3, lora_alpha=6, target_modules=["c_attn"], fan_in_fan_out=True),
                "all5": dict(r=5, lora_alpha=4, use_rslora=True, fan_in_fan_out=True,
                             target_modules=["c_attn", "c_proj", "c_fc"])}
    model_dir, adapters = _build(tmp_path, config, adapters)
    _check(model_dir, adapters, [30, 9, 21, 17], ["attn3", None, "all5", "all5"])


def test_gpt2_bare_model_keys(tmp_path):
    """The original gpt2 files name tensors as the bare GPT2Model does (h.0.attn.c_attn.weight, wte,
    with the causal-mask buffers h.N.attn.bias): the same weights as the prefixed layout."""
    from safetensors.torch import load_file, save_file

    from loraplex.gpu_engine.model.weights import load_weights

    config = transformers.GPT2Config(vocab_size=512, n_embd=64, n_layer=2, n_head=4, n_positions=128)
    model_dir, _ = _build(tmp_path, config, {})
    cfg = ModelConfig.from_dir(model_dir)
    want = load_weights(model_dir, cfg, device=torch.device("cpu"), dtype=torch.float32)
    tensors = {k.removeprefix("transformer."): v for k, v in load_file(model_dir / "model.safetensors").items()}
    tensors.update({f"h.{i}.attn.bias": torch.ones(1, 1, 128, 128).tril() for i in range(2)})
    save_file(tensors, str(model_dir / "model.safetensors"))
    got = load_weights(model_dir, cfg, device=torch.device("cpu"), dtype=torch.float32)
    assert torch.equal(got.pos_embed, want.pos_embed) and torch.equal(got.embed, want.embed)
    assert all(torch.equal(g.proj[m], w.proj[m]) for g, w in zip(got.layers, want.layers) for m in g.proj)


def test_gemma1(tmp_path):
    config = transformers.GemmaConfig(**TINY, head_dim=16)
    model_dir, adapters = _build(tmp_path, config, LLAMA_TARGETS, one_plus=True)
    _check(model_dir, adapters, [30, 7, 41, 19, 25], NAMES)


def test_phi_parallel_partial_rotary(tmp_path):
    model_dir, adapters = _phi(tmp_path)
    _check(model_dir, adapters, [30, 9, 21, 17], ["qv3", None, "all5", "mlp7"])


def test_qwen2_sliding_window_layers(tmp_path):
    config = transformers.Qwen2Config(**{**TINY, "num_hidden_layers": 3}, use_sliding_window=True,
                                      sliding_window=10, max_window_layers=1)
    model_dir, adapters = _build(tmp_path, config, {"qv3": LLAMA_TARGETS["qv3"]})
    cfg = ModelConfig.from_dir(model_dir)
    assert cfg.layer_windows == (None, 10, 10)
    _check(model_dir, adapters, [33, 8, 27], ["qv3", None, "qv3"])


@pytest.mark.parametrize("model_type", ["qwen3_moe", "qwen3_5", "qwen3_5_text", "qwen3_next", "nemotron_h"])
def test_refused_families(model_type):
    with pytest.raises(UnsupportedModelError, match=model_type):
        ModelConfig.from_hf({"model_type": model_type, **TINY})


def test_gemma3_vision_tensors_only_by_prefix(tmp_path):
    """The vision tower is read past by name; any other unknown tensor is still refused."""
    from safetensors.torch import load_file, save_file

    text = transformers.Gemma3TextConfig(**TINY, head_dim=16, sliding_window=10)
    config = transformers.Gemma3Config(text_config=text.to_dict(), vision_config=transformers.SiglipVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
        patch_size=14).to_dict(), mm_tokens_per_image=4)
    model_dir, _ = _build(tmp_path, config, {}, one_plus=True, model_cls=transformers.Gemma3ForConditionalGeneration)
    from loraplex.gpu_engine.model.weights import load_weights

    cfg = ModelConfig.from_dir(model_dir)
    load_weights(model_dir, cfg, device=torch.device("cpu"), dtype=torch.float32)
    tensors = load_file(model_dir / "model.safetensors")
    tensors["audio_tower.stray.weight"] = torch.randn(3)
    save_file(tensors, str(model_dir / "model.safetensors"))
    with pytest.raises(UnsupportedModelError, match="audio_tower"):
        load_weights(model_dir, cfg, device=torch.device("cpu"), dtype=torch.float32)
    assert json.loads((model_dir / "config.json").read_text())["model_type"] == "gemma3"


@pytest.mark.parametrize("build", [_phi3, _gemma2], ids=["phi3-fused", "gemma2"])
def test_merged_mode_equals_unmerged(tmp_path, build):
    """dLoRA merged mode folds s·B·A into the family's projections (fused ones whole) by their
    module_shapes names: merged base rows equal the unmerged adapter's; unmerge is bit-exact."""
    from loraplex.gpu_engine.lora.merge import merge_adapter, unmerge

    model_dir, adapters = build(tmp_path)
    llm = LLM(model_dir, page_tokens=8, num_pages=128)
    llm.add_adapter("all5", adapters["all5"])
    w = llm.executor.model.w
    before = {(i, m): t.clone() for i, layer in enumerate(w.layers) for m, t in layer.proj.items()}
    prompts = _prompts(9, [37, 11], llm.config.vocab_size)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=True)
    unmerged = llm.generate(prompts, adapters="all5", sampling=params)
    state = merge_adapter(w, llm.executor.host["all5"].adapter)
    merged = llm.generate(prompts, adapters=None, sampling=params)
    for got, want in zip(merged, unmerged):
        assert got.token_ids == want.token_ids
        assert max(abs(a - b) for a, b in zip(got.logprobs, want.logprobs)) < forward_tolerance(llm.config)
    unmerge(state)
    assert all(torch.equal(w.layers[i].proj[m], t) for (i, m), t in before.items())


def _phi(root: Path):
    config = transformers.PhiConfig(**TINY, partial_rotary_factor=0.5)
    adapters = {"qv3": dict(r=3, lora_alpha=6, target_modules=["q_proj", "dense"]),
                "all5": dict(r=5, lora_alpha=4, use_rslora=True,
                             target_modules=["q_proj", "k_proj", "v_proj", "dense", "fc1", "fc2"]),
                "mlp7": dict(r=7, lora_alpha=7, target_modules=["fc1", "fc2"])}
    return _build(root, config, adapters)


@pytest.mark.slow
@pytest.mark.parametrize("build", [_qwen3, _gemma2, _phi, _phi3], ids=["qwen3", "gemma2", "phi", "phi3-fused"])
def test_tp2_equals_single_device(tmp_path, build):
    """Families whose heads split run tensor-parallel: q/k norms, Gemma's extra norms and LayerNorm
    biases stay whole on every rank, Phi's LM head bias splits with the vocabulary, the final
    soft-cap applies to the gathered logits; Phi-3's fused qkv_proj / gate_up_proj split part by part
    (each rank its q, k, v heads and its gate and up columns, and the same rows of LoRA B)."""
    from tests.tp_engine_support import EngineCase, single_device, spawn_engine

    model_dir, adapters = build(tmp_path)
    prompts = _prompts(5, [9, 30, 17, 22], 512)
    case = EngineCase(model_dir=str(model_dir), adapters={n: str(p) for n, p in adapters.items()}, prompts=prompts,
                      names=["all5", None, "mlp7", next(iter(adapters))], new_tokens=3, page_tokens=8)
    out = tmp_path / "out"
    out.mkdir()
    [(tokens, logprobs)] = spawn_engine(2, [case], out)
    ref_tokens, ref_logprobs = single_device(case)
    assert torch.equal(tokens, ref_tokens)
    assert (logprobs - ref_logprobs).abs().max().item() < forward_tolerance(ModelConfig.from_dir(model_dir))


@pytest.mark.slow
def test_tp2_cpu_assisted_prefill_of_fused_projections(tmp_path):
    """Phi-3 split over two ranks with CPU workers on rank 0: the workers compute qkv_proj's and
    gate_up_proj's deltas whole, and each rank gets block j of each fused part (its q, k, v heads,
    its gate and up columns); greedy tokens and logprobs equal one device's without assist."""
    import dataclasses

    from loraplex.gpu_engine.demo import ensure_demo_model
    from tests.tp_engine_support import EngineCase, single_device, spawn_engine

    demo = ensure_demo_model(tmp_path / "demo", family="phi3")
    names = ["all-r32", None, "mlp-r64", "qv-r8"]
    prompts = _prompts(11, [9, 30, 17, 22], 512)
    case = EngineCase(str(demo.model_dir), {n: str(demo.adapters[n]) for n in names if n}, prompts, names,
                      new_tokens=3, cpu_assist=True, num_pages=600)
    ref_tokens, ref_logprobs = single_device(dataclasses.replace(case, cpu_assist=False))
    out = tmp_path / "out"
    out.mkdir()
    [(tokens, logprobs)] = spawn_engine(2, [case], out)  # drive() checks the workers' deltas arrived
    assert torch.equal(tokens, ref_tokens)
    assert (logprobs - ref_logprobs).abs().max().item() < forward_tolerance(ModelConfig.from_dir(demo.model_dir))


def test_tp_splits_fused_parts_and_refuses_conv1d():
    from loraplex.contracts.tensor_parallel import TensorParallelPlan
    from loraplex.gpu_engine.tp.partition import rank_slice

    cfg = ModelConfig.from_hf({"model_type": "phi3", **TINY})
    plan = TensorParallelPlan.for_model(cfg, 2)
    assert plan.fused_parts("qkv_proj") == (64, 32, 32) and plan.shard_shapes()["gate_up_proj"] == (64, 96)
    full = torch.arange(128.0)[:, None]
    rows = rank_slice("qkv_proj", "weight", (128, 1), plan, 1).take(full)[:, 0].tolist()
    assert rows == list(range(32, 64)) + list(range(80, 96)) + list(range(112, 128))  # its q, k and v heads
    gpt2 = ModelConfig.from_hf({"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4, "vocab_size": 512})
    with pytest.raises(ValueError, match="tensor_parallel_size=1"):
        TensorParallelPlan.for_model(gpt2, 2)
    assert TensorParallelPlan.for_model(gpt2, 1).full_shapes()["qkv_proj"] == (64, 192)


@pytest.mark.parametrize("family", ["phi3", "gpt2"])
def test_cpu_assist_runs_fused_projections(tmp_path, family):
    """The CPU workers' exchange has a slot per module of the model's module_shapes(): a fused
    family (Phi-3's qkv_proj / gate_up_proj, GPT-2's c_attn and an MLP without gate) keeps
    adapter_load_mode=cpu_assist when asked for it, and its exchange is laid out
    from those modules."""
    from loraplex.contracts.engine_spec import EngineSpec
    from loraplex.gpu_engine.demo import family_config, write_random_checkpoint
    from loraplex.gpu_engine.model.config import ModelConfig
    from loraplex.gpu_engine.runtime import resolve_spec
    from loraplex.ipc.exchange import exchange_layout

    write_random_checkpoint(tmp_path, family_config(family), seed=1)
    spec = resolve_spec(EngineSpec(model=str(tmp_path), device="cpu", adapter_load_mode="cpu_assist"))
    assert spec.adapter_load_mode == "cpu_assist"
    cfg = ModelConfig.from_dir(tmp_path)
    layout = exchange_layout("/lpx-test-fused", cfg.num_layers, cfg.module_shapes(), 8)
    assert layout.stage_modules(0) == ("qkv_proj",)
    assert layout.stage_modules(2) == (("gate_up_proj",) if family == "phi3" else ("up_proj",))
    assert layout.module_shape("qkv_proj") == (cfg.hidden_size, cfg.q_dim + 2 * cfg.kv_dim)
    assert layout.in_features(3) == cfg.intermediate_size


_TRITON_SCRIPT = """
import sys, tempfile
from pathlib import Path
import torch
from loraplex import LLM, SamplingParams
from loraplex.gpu_engine.demo import family_config, write_random_adapter, write_random_checkpoint
from loraplex.gpu_engine.demo.model import family_targets
from tests.tolerances import forward_tolerance

family, head_dim = sys.argv[1], int(sys.argv[2])
root = Path(tempfile.mkdtemp())
overrides = {"sliding_window": 8} if family in ("gemma2", "gemma3_text") else {}
if head_dim:
    overrides["head_dim"] = head_dim
config = family_config(family, **overrides)
write_random_checkpoint(root / "m", config, seed=5)
targets = family_targets(config, ("q_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"))
write_random_adapter(root / "a", config, rank=5, alpha=10.0, target_modules=targets, seed=6)
g = torch.Generator().manual_seed(7)
prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (19, 6)]
params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, logprobs=True)
outs = {}
for backend in ("torch", "triton"):
    llm = LLM(root / "m", lora_backend=backend, page_tokens=8, num_pages=96, dtype="float32")
    llm.add_adapter("a", root / "a")
    outs[backend] = llm.generate(prompts, adapters=["a", None], sampling=params)
for a, b in zip(outs["torch"], outs["triton"]):
    assert a.token_ids == b.token_ids, (family, a.token_ids, b.token_ids)
    assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < forward_tolerance(llm.config), family
print("ok")
"""


@pytest.mark.slow
@pytest.mark.parametrize("family,head_dim", [("qwen3", 0), ("gemma2", 0), ("gemma2", 256), ("gemma3_text", 0),
                                             ("phi3", 0), ("phi", 0), ("gpt2", 0)])
def test_triton_interpreter_equals_torch_backend(family, head_dim):
    """The Triton LoRA and paged-attention kernels (interpreted on CPU) over each family's forward:
    fused modules, soft-caps, per-layer windows, head_dim 256, partial rotary, learned positions."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, "-c", _TRITON_SCRIPT, family, str(head_dim)], env=env,
                          capture_output=True, text=True, timeout=600, cwd=Path(__file__).parent.parent)
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-3000:]


def test_gemma3_legacy_rope_fields():
    """Hub-era Gemma 3 configs: rope_theta and rope_local_base_freq at the top, a flat rope_scaling
    that scales the global layers only."""
    cfg = ModelConfig.from_hf({"model_type": "gemma3_text", **TINY, "head_dim": 16, "rope_theta": 1e6,
                               "rope_local_base_freq": 1e4, "rope_scaling": {"rope_type": "linear", "factor": 8.0},
                               "sliding_window": 16, "sliding_window_pattern": 2})
    assert (cfg.rope_theta, cfg.local_rope_theta, cfg.rope_scaling.factor) == (1e6, 1e4, 8.0)
    assert cfg.layer_windows == (16, None)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gemma2", "phi", "phi3", "gpt2"])
def test_daemon_cpu_assist_serves_the_offline_tokens(tmp_path, family):
    """Through a daemon, with CPU workers computing the early layers' LoRA while a throttled load
    streams in (the CPU-assist hooks around Gemma 2's sandwich norms, Phi's parallel residual,
    Phi-3's fused qkv_proj / gate_up_proj, GPT-2's fused c_attn and MLP without gate): the offline
    API's tokens."""
    from loraplex.gpu_engine.demo import ensure_demo_model
    from tests.daemon_process import cpu_assisted_greedy

    demo = ensure_demo_model(tmp_path / "demo", family=family)
    names = ["all-r32", "mlp-r64", None, "qv-r8"]
    g = torch.Generator().manual_seed(17)
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() * 3 for n in (20, 33, 9, 41)]
    llm = LLM(demo.model_dir, num_pages=600)
    for name in set(names) - {None}:
        llm.add_adapter(name, demo.adapters[name])
    expected = llm.generate(prompts, adapters=names, sampling=SamplingParams(max_tokens=6, temperature=0.0,
                                                                              ignore_eos=True))
    got, stats = cpu_assisted_greedy(tmp_path / "d", demo.model_dir, demo.adapters, prompts, names, 6)
    assert [r.token_ids for r in got] == [e.token_ids for e in expected]
    assert "cpu_assisted" in [r.timings["adapter_path"] for r in got], stats.get("cpu_assist")
    # the workers computed those rows' deltas (no site fell back to the engine's own host computation)
    assert stats["cpu_assist"]["jobs"] > 0 and stats["cpu_assist"]["busy_ms"] > 0, stats["cpu_assist"]
    assert stats["cpu_timeouts"] == 0 and stats["cpu_assist"]["failures"] == 0, stats["cpu_assist"]


def test_gemma1_reads_hidden_act_and_its_legacy_gelu():
    """transformers' Gemma 1 takes hidden_act (a legacy "gelu" meaning the tanh GeLU); Gemma 2/3 take
    hidden_activation; an activation the engine lacks is refused by name."""
    assert ModelConfig.from_hf({"model_type": "gemma", **TINY, "hidden_act": "gelu",
                                "hidden_activation": None}).activation == "gelu_tanh"
    with pytest.raises(UnsupportedModelError, match="hidden_activation"):
        ModelConfig.from_hf({"model_type": "gemma2", **TINY, "hidden_activation": "relu"})


def test_tp_merged_slices_of_fused_modules():
    """dLoRA merged mode on a rank: s·B·A of its merge slices is its rows (weight shard) of the whole
    delta, fused qkv_proj / gate_up_proj part by part."""
    from pathlib import Path as _Path

    from loraplex.contracts.tensor_parallel import TensorParallelPlan
    from loraplex.gpu_engine.lora.peft_adapter import AdapterSpec, HostAdapter
    from loraplex.gpu_engine.tp.partition import merge_slices, rank_slice

    cfg = ModelConfig.from_hf({"model_type": "phi3", **TINY})
    plan = TensorParallelPlan.for_model(cfg, 2)
    g = torch.Generator().manual_seed(0)
    shapes = cfg.module_shapes()
    a = [{m: torch.randn(3, fi, generator=g) for m, (fi, fo) in shapes.items()}]
    b = [{m: torch.randn(fo, 3, generator=g) for m, (fi, fo) in shapes.items()}]
    adapter = HostAdapter(name="x", path=_Path("."), spec=AdapterSpec(3, 3.0, False, tuple(shapes)), a=a, b=b)
    for rank in range(2):
        part = merge_slices(adapter, plan, rank)
        for m, (fi, fo) in shapes.items():
            full = b[0][m] @ a[0][m]  # [out, in]
            want = rank_slice(m, "weight", (fo, fi), plan, rank).take(full)
            torch.testing.assert_close(part.b[0][m] @ part.a[0][m], want)
