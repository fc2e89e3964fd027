"""The adapter census (bench/adapter_census.py, issue 32) runs on sampled public configs.

Three rows of families loraplex serves (a Llama-3.2 adapter on a tied, llama3-RoPE base; a
Mistral-7B-v0.1 one with its sliding window shorter than the prompt; a Qwen2.5 one on a tied
base) must come out served_equal against transformers + PEFT, and a Falcon-7B adapter (a base
loraplex refuses) must come out as a clear refusal naming the model_type. The sample's bookkeeping
(categories, the base-name table) is checked without running anything.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.bench_env import user_env

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "adapter_census.py"
SAMPLE = ROOT / "bench" / "data" / "adapter_census.json"

SERVED = {6: "llama", 23: "mistral", 27: "qwen2"}
REFUSED_FALCON = 126


def _sample() -> dict:
    return json.loads(SAMPLE.read_text())


def test_sample_rows_the_test_uses_are_what_it_says():
    rows = {r["id"]: r for r in _sample()["adapters"]}
    for i, model_type in {**SERVED, REFUSED_FALCON: "falcon"}.items():
        assert rows[i]["category"] == "decoder_lora" and rows[i]["model_type"] == model_type
    assert rows[23]["features"] == {"sliding_window": True}
    assert rows[6]["features"]["tie_word_embeddings"] is True


def test_sample_is_bounded_and_categorised():
    sample = _sample()
    assert SAMPLE.stat().st_size < 1 << 20
    assert len(sample["adapters"]) >= 190
    cats = {r["category"] for r in sample["adapters"]}
    assert cats <= set(sample["header"]["categories"])
    for r in sample["adapters"]:
        if r["category"] == "decoder_lora":
            assert str(r["config"]["peft_type"]).upper() == "LORA"
            assert r["weights"] in ("safetensors", "bin", "both", "not_in_repo")


def test_base_table_resolves_names_and_local_paths():
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        from adapter_census_bases import resolve_base
    finally:
        sys.path.remove(str(ROOT / "bench"))
    assert resolve_base("unsloth/llama-3.2-3b-instruct-unsloth-bnb-4bit")[0] == "llama"
    assert resolve_base("distilbert/distilgpt2")[0] == "gpt2"
    assert resolve_base("/kaggle/input/qwen25-15b-weights/qwen_files/Qwen/Qwen2___5-1___5B-Instruct") == (
        "qwen2", {"tie_word_embeddings": True})
    assert resolve_base("google/gemma-3-4b-it")[0] == "gemma3"
    assert resolve_base("google/gemma-3-270m-it")[0] == "gemma3_text"
    assert resolve_base("Hugofernandez/Mistral-7B-v0.1-colab-sharded") == ("mistral", {"sliding_window": True})
    assert resolve_base("base_model") == (None, {})


@pytest.mark.slow  # ~20-30 s on 2 busy cores: four tiny bases built, transformers + PEFT and loraplex each run
def test_census_rows_served_equal_and_a_refused_base(tmp_path):
    ids = [*SERVED, REFUSED_FALCON]
    proc = subprocess.run([sys.executable, str(SCRIPT), "--json", "--ids", *map(str, ids)], cwd=ROOT,
                          env=user_env(LORAPLEX_CACHE_DIR=str(tmp_path)), capture_output=True, text=True,
                          timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(proc.stdout)
    rows = {r["id"]: r for r in report["rows"]}
    for i in SERVED:
        assert rows[i]["outcome"] == "served_equal", rows[i]
        assert rows[i]["max_logprob_error"] < 1e-3
    falcon = rows[REFUSED_FALCON]
    assert falcon["outcome"] == "unsupported_base", falcon
    assert "falcon" in falcon["error"]
    summary = report["summary"]
    assert summary["served_equal"] == 3 and summary["denominator"] == 4
    assert summary["refusal_reasons_top10"][0]["count"] == 1
