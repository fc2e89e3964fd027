"""Bad inputs raise clear, specific errors and leave the engine usable and unchanged."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from loraplex import LLM, SamplingParams
from loraplex.errors import (
    AdapterError,
    AdapterRankError,
    InvalidTokenError,
    PromptTooLongError,
    UnknownAdapterError,
)
from loraplex.gpu_engine.demo import write_random_adapter

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
PROMPT = [5, 17, 99, 240, 31, 7, 300, 12]


@pytest.fixture(scope="module")
def llm(demo):
    engine = LLM(demo.model_dir, num_pages=128, max_model_len=256)
    engine.add_adapter("qv", demo.adapters["qv-r8"])
    return engine


@pytest.fixture(scope="module")
def baseline(llm):
    return [o.token_ids for o in llm.generate([PROMPT, PROMPT], adapters=[None, "qv"], sampling=GREEDY)]


def _still_usable(llm: LLM, baseline) -> None:
    outs = llm.generate([PROMPT, PROMPT], adapters=[None, "qv"], sampling=GREEDY)
    assert [o.token_ids for o in outs] == baseline
    assert llm.allocator.usage().by_tag.get("kv", 0) == 0


def _demo_config(demo) -> dict:
    return json.loads((demo.model_dir / "config.json").read_text())


def _copy_adapter(demo, tmp_path: Path, name: str = "qv-r8") -> Path:
    dest = tmp_path / "adapter"
    shutil.copytree(demo.adapters[name], dest)
    return dest


def test_unknown_adapter(llm, baseline):
    with pytest.raises(UnknownAdapterError, match="nope"):
        llm.generate([PROMPT, PROMPT], adapters=["qv", "nope"], sampling=GREEDY)
    _still_usable(llm, baseline)


def test_prompt_longer_than_context(llm, baseline):
    with pytest.raises(PromptTooLongError, match="256"):
        llm.generate([PROMPT, list(range(3, 300))], sampling=GREEDY)
    _still_usable(llm, baseline)


@pytest.mark.parametrize("bad_token", [512, -1, 10**9])
def test_token_outside_vocabulary(llm, baseline, bad_token):
    with pytest.raises(InvalidTokenError, match="vocabulary"):
        llm.generate([PROMPT + [bad_token]], sampling=GREEDY)
    _still_usable(llm, baseline)


def test_rank_above_max_lora_rank(demo, tmp_path):
    engine = LLM(demo.model_dir, num_pages=64, max_lora_rank=16)
    engine.add_adapter("ok", demo.adapters["attn-r16"])
    with pytest.raises(AdapterRankError, match="max_lora_rank=16") as refused:
        engine.add_adapter("big", demo.adapters["all-r32"])
    # errors name the adapter as it was registered, not its directory
    assert str(refused.value).startswith("adapter big:") and "all-r32" not in str(refused.value)
    assert engine.adapters() == ["ok"]


def test_pickle_adapter_refused(llm, baseline, demo, tmp_path):
    path = _copy_adapter(demo, tmp_path)
    (path / "adapter_model.safetensors").unlink()
    (path / "adapter_model.bin").write_bytes(b"\x80\x04K\x01.")  # a pickle: must never be opened
    with pytest.raises(AdapterError, match="pickle"):
        llm.add_adapter("pickled", path)
    _still_usable(llm, baseline)


def test_missing_files(llm, baseline, demo, tmp_path):
    with pytest.raises(AdapterError, match="does not exist"):
        llm.add_adapter("ghost", tmp_path / "nowhere")
    path = _copy_adapter(demo, tmp_path)
    (path / "adapter_model.safetensors").unlink()
    with pytest.raises(AdapterError, match="missing"):
        llm.add_adapter("noweights", path)
    (path / "adapter_config.json").unlink()
    with pytest.raises(AdapterError, match="adapter_config.json"):
        llm.add_adapter("noconfig", path)
    assert "noweights" not in llm.adapters()
    _still_usable(llm, baseline)


@pytest.mark.parametrize("extra, message", [
    ({"use_dora": True}, "DoRA"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ({"bias": "lora_only"}, "biases"),
    ({"layers_to_transform": [0]}, "does not select"),  # served, but the file holds every layer
    ({"rank_pattern": {"q_proj": 4}}, "shape"),  # served, but the file's q_proj tensors are rank 8
    ({"peft_type": "IA3"}, "peft_type"),
    ({"target_modules": ["q_proj", "score"]}, "score .the output layer. is not served"),
])
def test_unsupported_adapter_features(llm, baseline, demo, tmp_path, extra, message):
    path = tmp_path / "bad"
    write_random_adapter(path, _demo_config(demo), rank=8, alpha=8, target_modules=["q_proj", "v_proj"], seed=1,
                         extra_config=extra)
    with pytest.raises(AdapterError, match=message):
        llm.add_adapter("bad", path)
    assert "bad" not in llm.adapters()
    _still_usable(llm, baseline)


def test_shape_mismatch_and_corrupt_file(llm, baseline, demo, tmp_path):
    other = dict(_demo_config(demo), hidden_size=128, intermediate_size=256)
    write_random_adapter(tmp_path / "wrong", other, rank=8, alpha=8, target_modules=["q_proj"], seed=2)
    with pytest.raises(AdapterError, match="shape"):
        llm.add_adapter("wrong", tmp_path / "wrong")
    path = _copy_adapter(demo, tmp_path)
    (path / "adapter_model.safetensors").write_bytes(b"\x00" * 7)
    with pytest.raises(AdapterError, match="cannot read"):
        llm.add_adapter("corrupt", path)
    _still_usable(llm, baseline)


def test_bad_sampling_params_and_names(llm, baseline):
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=float("nan"))
    with pytest.raises(AdapterError, match="name"):
        llm.add_adapter("../etc", "/tmp")
    with pytest.raises(AdapterError, match="already"):
        llm.add_adapter("qv", "/tmp")
    with pytest.raises(ValueError, match="3 prompts"):
        llm.generate([PROMPT] * 3, adapters=[None, "qv"], sampling=GREEDY)
    _still_usable(llm, baseline)


def test_remove_adapter(demo):
    engine = LLM(demo.model_dir, num_pages=64)
    engine.add_adapter("x", demo.adapters["qv-r8"])
    engine.generate([PROMPT], adapters=["x"], sampling=GREEDY)
    assert engine.allocator.usage().by_tag.get("adapter", 0) > 0  # stays cached after use
    engine.remove_adapter("x")
    assert engine.allocator.usage().by_tag.get("adapter", 0) == 0
    with pytest.raises(UnknownAdapterError):
        engine.generate([PROMPT], adapters=["x"], sampling=GREEDY)
    with pytest.raises(UnknownAdapterError):
        engine.remove_adapter("x")


def test_unsupported_backend_and_device(demo):
    with pytest.raises(ValueError, match="lora_backend must be one of"):
        LLM(demo.model_dir, lora_backend="punica")
    with pytest.raises(ValueError, match="dtype"):
        LLM(demo.model_dir, dtype="float64")


def test_executor_failure_mid_generate_leaves_engine_usable(llm, baseline, monkeypatch):
    real = llm.executor.execute
    calls = {"n": 0}

    def flaky(plan):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("simulated device fault")
        return real(plan)

    monkeypatch.setattr(llm.executor, "execute", flaky)
    with pytest.raises(RuntimeError, match="simulated"):
        llm.generate([PROMPT, PROMPT], adapters=[None, "qv"], sampling=GREEDY)
    assert not llm.scheduler.has_work()
    _still_usable(llm, baseline)
