"""LoRA on the token embedding and the LM head (peft's `embed_tokens` / `lm_head` targets, GPT-2's
`wte`), served like every other module: each head module's rows spread over the layers' pool slots,
applied per adapter segment in mixed batches with base rows and adapters without them. Against
transformers + PEFT (float32, greedy tokens equal, chosen-token logprobs within
tests/tolerances.forward_tolerance): an untied Llama, a tied Qwen2, Gemma 2 (a scaled, tied
embedding and a final soft-cap) and GPT-2 (wte, Conv1D); prompt logprobs through the adapted LM
head; layer-group loads; dLoRA merged mode with a tied head (untied while merged, tied again bit-
exactly); the layout's arithmetic; and what is still refused (tensor parallelism, other output
layers, misnamed tensors)."""
from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

from loraplex import LLM, SamplingParams
from loraplex.contracts.head_modules import SpreadRows, head_modules
from loraplex.contracts.tensor_parallel import TensorParallelPlan
from loraplex.errors import AdapterError
from loraplex.gpu_engine.lora.peft_adapter import load_peft_adapter, read_adapter_spec
from loraplex.gpu_engine.model.config import ModelConfig
from tests.hf_reference import greedy, prompt_logprobs
from tests.test_architectures import TINY, _check, _prompts, _randomize
from tests.tolerances import forward_tolerance

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")



def _config(family: str):
    if family == "llama":
        return transformers.LlamaConfig(**TINY, tie_word_embeddings=False)
    if family == "qwen2":
        return transformers.Qwen2Config(**TINY, tie_word_embeddings=True)
    if family == "gemma2":
        return transformers.Gemma2Config(**{**TINY, "num_hidden_layers": 3}, head_dim=16, sliding_window=12,
                                         attn_logit_softcapping=3.0, final_logit_softcapping=6.0,
                                         query_pre_attn_scalar=24, attn_implementation="eager")
    return transformers.GPT2Config(vocab_size=512, n_embd=64, n_layer=2, n_head=4, n_positions=128)


def _adapters(family: str) -> dict[str, dict]:
    gpt2 = family == "gpt2"
    embed, attn, mlp = ("wte", ["c_attn"], ["c_fc"]) if gpt2 else ("embed_tokens", ["q_proj", "v_proj"], ["up_proj"])
    return {
        "heads5": dict(r=5, lora_alpha=10, target_modules=[*attn, "lm_head", embed]),
        "lmhead3": dict(r=3, lora_alpha=6, use_rslora=True, target_modules=["lm_head"]),
        "embed4": dict(r=4, lora_alpha=4, target_modules=[embed, *mlp]),
        "plain3": dict(r=3, lora_alpha=6, target_modules=attn),
    }


def _build(root: Path, family: str) -> tuple[Path, dict[str, Path]]:
    """A tiny random checkpoint of the family and peft adapters with random A and B, scaled so that
    they move the greedy tokens without swamping the base model."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(_config(family)).to(torch.float32).eval()
    _randomize(model, one_plus=family == "gemma2")
    model_dir = root / "model"
    model.save_pretrained(model_dir, safe_serialization=True)
    out = {}
    for i, (name, kwargs) in enumerate(_adapters(family).items()):
        torch.manual_seed(100 + i)
        adapted = peft.get_peft_model(copy.deepcopy(model),
                                      peft.LoraConfig(init_lora_weights=False, lora_dropout=0.0, **kwargs))
        with torch.no_grad():
            for key, p in adapted.named_parameters():
                if "lora_embedding" in key:
                    p.mul_(0.2)  # peft draws both embedding factors from N(0, 1)
        adapted.save_pretrained(root / name)
        out[name] = root / name
    return model_dir, out


@pytest.fixture(scope="module", params=["llama", "qwen2", "gemma2", "gpt2"])
def family(request, tmp_path_factory):
    model_dir, adapters = _build(tmp_path_factory.mktemp(request.param), request.param)
    return request.param, model_dir, adapters


NAMES = ["heads5", None, "lmhead3", "embed4", "plain3", "heads5"]


def test_mixed_batch_equals_transformers_and_peft(family):
    name, model_dir, adapters = family
    cfg = ModelConfig.from_dir(model_dir)
    assert cfg.tie_word_embeddings == (name != "llama")
    spec = read_adapter_spec(adapters["heads5"], cfg, 64)
    assert {"embed_tokens", "lm_head"} <= set(spec.targets)
    # random GPT-2 weights repeat one token for most prompts: lengths where the reference does not
    lengths = [30, 9, 21, 17, 12, 25] if name == "gpt2" else [23, 9, 31, 17, 12, 5]
    _check(model_dir, adapters, lengths, NAMES)


def test_layer_group_loads_and_prompt_logprobs(family):
    """Adapters arriving in layer groups (the head modules' parts ride in the first) and prompt
    logprobs scored through each row's adapted LM head, in one mixed batch."""
    name, model_dir, adapters = family
    llm = LLM(model_dir, page_tokens=8, num_pages=256, load_groups=2)
    for adapter, path in adapters.items():
        llm.add_adapter(adapter, path)
    names = ["lmhead3", None, "heads5", "embed4"]
    prompts = _prompts(7, [19, 11, 26, 14], llm.config.vocab_size)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=True, prompt_logprobs=0)
    outs = llm.generate(prompts, adapters=names, sampling=params)
    tol = forward_tolerance(llm.config)
    for prompt, adapter, out in zip(prompts, names, outs):
        path = adapters.get(adapter) if adapter else None
        tokens, logprobs = greedy(model_dir, path, prompt, 6)
        assert out.token_ids == tokens, f"{name}/{adapter}: tokens differ"
        assert max(abs(a - b) for a, b in zip(out.logprobs, logprobs)) < tol
        ref = prompt_logprobs(model_dir, path, prompt)
        want = [float(ref[p, prompt[p + 1]]) for p in range(len(prompt) - 1)]
        assert out.prompt_logprobs[0] is None
        worst = max(abs(a - b) for a, b in zip(out.prompt_logprobs[1:], want))
        assert worst < tol, f"{name}/{adapter}: prompt logprob error {worst} over {tol:.2g}"


def test_merged_mode_with_head_modules_equals_unmerged(family):
    """dLoRA merged mode folds s·B·A into the embedding and the LM head too; a tied head is merged
    apart from the embedding (decode graphs step aside meanwhile) and tied again; unmerge restores
    every weight bit for bit."""
    from loraplex.gpu_engine.lora.merge import merge_adapter, unmerge

    name, model_dir, adapters = family
    llm = LLM(model_dir, page_tokens=8, num_pages=128)
    llm.add_adapter("heads5", adapters["heads5"])
    w = llm.executor.model.w
    tied = w.lm_head is w.embed
    before = {"embed": w.embed.clone(), "lm_head": w.lm_head.clone(),
              **{(i, m): t.clone() for i, layer in enumerate(w.layers) for m, t in layer.proj.items()}}
    prompts = _prompts(9, [21, 8], llm.config.vocab_size)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=True)
    unmerged = llm.generate(prompts, adapters="heads5", sampling=params)
    state = merge_adapter(w, llm.executor.host["heads5"].adapter)
    assert state.untied == tied and (w.lm_head is not w.embed)
    merged = llm.generate(prompts, adapters=None, sampling=params)
    for got, want in zip(merged, unmerged):
        assert got.token_ids == want.token_ids
        assert max(abs(a - b) for a, b in zip(got.logprobs, want.logprobs)) < forward_tolerance(llm.config)
    unmerge(state)
    assert (w.lm_head is w.embed) == tied
    assert torch.equal(w.embed, before["embed"]) and torch.equal(w.lm_head, before["lm_head"])
    assert all(torch.equal(w.layers[i].proj[m], before[(i, m)]) for i, layer in enumerate(w.layers)
               for m in layer.proj)


@pytest.mark.parametrize("width,layers,widest", [(512, 2, 96), (151936, 24, 4864), (64, 3, 96), (7, 4, 3)])
def test_spread_rows_cover_the_width_within_the_widest_row(width, layers, widest):
    side = SpreadRows.of(width, layers, widest)
    assert side.piece <= widest
    assert layers * side.per_layer >= width > layers * side.per_layer - layers * side.pieces
    heads = head_modules(hidden_size=64, vocab_size=width, num_layers=layers, widest_row=max(widest, 64),
                         embed_path="model.embed_tokens", lm_head_path="lm_head")
    assert heads["lm_head"].lora_rows(5)[2] == 5 * heads["lm_head"].b.pieces


def test_host_adapter_parts_reassemble_peft_tensors(family, tmp_path):
    """Each layer holds its part of lora_A / lora_B; concatenated, they are peft's tensors (zero padded)."""
    from safetensors.torch import load_file

    name, model_dir, adapters = family
    cfg = ModelConfig.from_dir(model_dir)
    adapter = load_peft_adapter("heads5", adapters["heads5"], cfg, max_lora_rank=64, dtype=torch.float32)
    saved = load_file(str(adapters["heads5"] / "adapter_model.safetensors"))
    embed, head = cfg.head_modules()["embed_tokens"], cfg.head_modules()["lm_head"]
    for module, a_key, b_key in ((head, f"base_model.model.{head.path}.lora_A.weight",
                                  f"base_model.model.{head.path}.lora_B.weight"),
                                 (embed, f"base_model.model.{embed.path}.lora_embedding_A",
                                  f"base_model.model.{embed.path}.lora_embedding_B")):
        a = torch.cat([layer[module.name] for layer in adapter.a], dim=1)
        b = torch.cat([layer[module.name] for layer in adapter.b], dim=0)
        assert torch.equal(a[:, :module.fan_in], saved[a_key]) and not a[:, module.fan_in:].any()
        assert torch.equal(b[:module.fan_out], saved[b_key]) and not b[module.fan_out:].any()


def _llama(root: Path) -> Path:
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY, tie_word_embeddings=False))
    model.save_pretrained(root / "model", safe_serialization=True)
    return root / "model"


def _adapter(model_dir: Path, dest: Path, **lora) -> Path:
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    peft.get_peft_model(model, peft.LoraConfig(lora_dropout=0.0, **lora)).save_pretrained(dest)
    return dest


def test_what_stays_refused(tmp_path):
    """all-linear leaves the LM head out, as peft does; other output layers and a lora_A named on an
    embedding are refused with the module named; tensor-parallel ranks refuse head modules."""
    model_dir = _llama(tmp_path)
    cfg = ModelConfig.from_dir(model_dir)
    spec = read_adapter_spec(_adapter(model_dir, tmp_path / "all", r=4, target_modules="all-linear"), cfg, 64)
    assert "lm_head" not in spec.targets and "q_proj" in spec.targets
    path = _adapter(model_dir, tmp_path / "score", r=4, target_modules=["q_proj"])
    config = json.loads((path / "adapter_config.json").read_text())
    (path / "adapter_config.json").write_text(json.dumps({**config, "target_modules": ["q_proj", "score"]}))
    with pytest.raises(AdapterError, match="score .the output layer. is not served"):
        read_adapter_spec(path, cfg, 64)
    from safetensors.torch import load_file, save_file

    path = _adapter(model_dir, tmp_path / "embed", r=4, target_modules=["embed_tokens"])
    tensors = load_file(str(path / "adapter_model.safetensors"))
    renamed = {k.replace("lora_embedding_A", "lora_A.weight"): v for k, v in tensors.items()}
    save_file(renamed, str(path / "adapter_model.safetensors"))
    with pytest.raises(AdapterError, match="lora_embedding_A/B on an embedding"):
        load_peft_adapter("embed", path, cfg, max_lora_rank=64, dtype=torch.float32)
    # peft's copy of the base embedding, served when equal to the base's, refused once trained
    path = _adapter(model_dir, tmp_path / "trained-copy", r=4, target_modules=["embed_tokens"])
    tensors = load_file(str(path / "adapter_model.safetensors"))
    copy_key = next(k for k in tensors if k.endswith("embed_tokens.base_layer.weight"))
    load_peft_adapter("copy", path, cfg, max_lora_rank=64, dtype=torch.float32)
    tensors[copy_key] = tensors[copy_key].clone()
    tensors[copy_key][7, 3] += 0.5
    save_file(tensors, str(path / "adapter_model.safetensors"))
    with pytest.raises(AdapterError, match="saved embed_tokens weights differ from the base model's"):
        load_peft_adapter("copy", path, cfg, max_lora_rank=64, dtype=torch.float32)
    plan = TensorParallelPlan.for_model(cfg, 2)
    with pytest.raises(ValueError, match="LoRA on lm_head is not split over tensor-parallel ranks"):
        plan.adapter_layout(plan.geometry(8), ["q_proj", "lm_head"], 4)


def test_daemon_serves_head_adapters_with_cpu_assisted_prefill(tmp_path):
    """Through a daemon with CPU workers and a throttled layer-group load: the host store carries
    the head modules' parts, the workers compute the early layers' projections and skip the head
    modules (the engine applies those, once the first group has arrived); the tokens are the
    offline API's, which equal PEFT's above."""
    from tests.daemon_process import cpu_assisted_greedy

    model_dir, adapters = _build(tmp_path, "qwen2")
    names = ["heads5", "plain3", None, "lmhead3"]
    prompts = [p * 3 for p in _prompts(11, [20, 33, 9, 41], 512)]
    llm = LLM(model_dir, num_pages=600)
    for name in set(names) - {None}:
        llm.add_adapter(name, adapters[name])
    expected = llm.generate(prompts, adapters=names, sampling=SamplingParams(max_tokens=6, temperature=0.0,
                                                                              ignore_eos=True))
    got, stats = cpu_assisted_greedy(tmp_path / "d", model_dir, adapters, prompts, names, 6)
    assert [r.token_ids for r in got] == [e.token_ids for e in expected]
    assert "cpu_assisted" in [r.timings["adapter_path"] for r in got], stats.get("cpu_assist")
    assert stats["cpu_assist"]["jobs"] > 0 and stats["cpu_assist"]["failures"] == 0, stats["cpu_assist"]
