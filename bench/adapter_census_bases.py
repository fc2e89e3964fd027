"""Which architecture a public adapter's `base_model_name_or_path` names (adapter census, issue 32).

Hub model names and local paths (`/content/llama3_model/models--meta-llama--Meta-Llama-3-8B/...`)
are mapped to the base's transformers `model_type` by the explicit table below (the bases'
config.json files are not in the public-code index the sample was drawn from), with the features
of that base the census keeps in its tiny random stand-in: tied embeddings, sliding windows, RoPE
scaling. Pure data and one function: no torch, no transformers.
"""
from __future__ import annotations

import re
from typing import Any

# Architectures of causal decoder-only LLMs (what a multi-LoRA LLM server is asked to serve).
DECODER_ONLY = frozenset({
    "llama", "mistral", "qwen2", "qwen3", "qwen3_5", "gemma", "gemma2", "gemma3", "gemma3_text", "gemma4",
    "phi", "phi3", "gpt2", "gpt_neox", "falcon", "codegen", "hunyuan_v1_dense", "exaone4", "nemotron_h",
    "chatglm", "glm4", "internlm", "baichuan", "openelm",
})
# Architectures transformers 5.24 has no class for (remote code on the Hub): a census row for
# one cannot have a transformers + PEFT reference, so it is reported apart (reference_failed).
REMOTE_CODE = frozenset({"chatglm", "internlm", "baichuan", "openelm"})
# Other bases in the sample, and why they are outside the census.
NOT_DECODER = {
    "bert": "encoder", "distilbert": "encoder", "roberta": "encoder", "new": "encoder",
    "t5": "seq2seq", "m2m_100": "seq2seq",
    "paligemma": "vision-language", "qwen2_5_vl": "vision-language", "qwen3_vl": "vision-language",
    "llava": "vision-language", "pixtral": "vision-language",
}

_LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
_TIED = {"tie_word_embeddings": True}
_UNTIED = {"tie_word_embeddings": False}
_MISTRAL_V01 = {"sliding_window": True}  # True: the tiny stand-in gets a window shorter than the prompt

# (regex searched in the lower-cased name, model_type, features). First match wins, so the
# specific patterns (vision-language checkpoints, sizes that tie embeddings) come first.
BASE_TABLE: tuple[tuple[str, str, dict[str, Any]], ...] = (
    # vision-language and other non-decoder checkpoints
    (r"paligemma", "paligemma", {}),
    (r"qwen2\.5-vl|qwen2_5_vl", "qwen2_5_vl", {}),
    (r"qwen3-vl", "qwen3_vl", {}),
    (r"llava", "llava", {}),
    (r"pixtral", "pixtral", {}),
    (r"dialogpt|distilgpt2|(^|/)gpt2", "gpt2", {}),  # before "distilbert": distilbert/distilgpt2
    (r"distilbert", "distilbert", {}),
    (r"codebert|roberta", "roberta", {}),
    (r"bert-base", "bert", {}),
    (r"stella_en", "new", {}),
    (r"nllb", "m2m_100", {}),
    (r"(^|/)t5-", "t5", {}),
    # Qwen
    (r"qwen3\.5", "qwen3_5", {}),
    (r"qwen3-(0\.6b|1\.7b|4b)", "qwen3", _TIED),
    (r"qwen3-", "qwen3", _UNTIED),
    (r"qwen2(\.5|___5)?-(coder-|math-)?(0\.5b|1\.5b|1___5b|3b)", "qwen2", _TIED),
    (r"qwen2(\.5)?-(coder-|math-)?(7b|14b|32b|72b)", "qwen2", _UNTIED),
    (r"qwen1\.5-(0\.5b|1\.8b|4b)", "qwen2", _TIED),  # Qwen1.5 checkpoints are model_type qwen2
    (r"qwen1\.5-", "qwen2", _UNTIED),
    # Gemma
    (r"gemma-4-e", "gemma4", {}),
    (r"gemma-?3-(4b|12b|27b)", "gemma3", {}),
    (r"gemma-?3-?(270m|1b)", "gemma3_text", {}),
    (r"gemma-2-", "gemma2", {}),
    (r"gemma-(2b|7b)", "gemma", {}),
    # Llama and its derivatives
    (r"llama-3\.2-(1b|3b)", "llama", {**_TIED, "rope_scaling": _LLAMA3_ROPE}),
    (r"llama-3\.1-|meta-llama-3\.1", "llama", {**_UNTIED, "rope_scaling": _LLAMA3_ROPE}),
    (r"llama-3-|meta-llama-3-|llama3", "llama", _UNTIED),
    (r"llama-poro-2", "llama", {**_UNTIED, "rope_scaling": _LLAMA3_ROPE}),  # a Llama-3.1-8B continuation
    (r"foundation-sec-8b", "llama", {**_UNTIED, "rope_scaling": _LLAMA3_ROPE}),  # Llama-3.1-8B based
    (r"tinyllama", "llama", _UNTIED),
    (r"open_llama", "llama", _UNTIED),
    (r"smollm2?-1\.7b", "llama", _TIED),
    (r"deepseek-(llm|coder)", "llama", _UNTIED),
    (r"llamion", "llama", _UNTIED),
    (r"ulizallama", "llama", _UNTIED),
    (r"llama-?2|llama-7b|llama/7b|llama-2-13b", "llama", _UNTIED),
    # Mistral: v0.1 (and models built on it) has a 4,096-token sliding window; v0.2 and v0.3 none
    (r"mistral-7b-v0\.1|mistral-7b-openorca|zephyr", "mistral", _MISTRAL_V01),
    (r"mistral-7b", "mistral", {}),
    # Phi
    (r"phi-3\.5-mini", "phi3", {"rope_scaling": "longrope"}),
    (r"phi-3-mini-4k", "phi3", {"sliding_window": True}),
    (r"phi-1_5|phi-2", "phi", {}),
    # other decoders
    (r"pythia|open-calm", "gpt_neox", {}),
    (r"falcon-7b", "falcon", {}),
    (r"codegen-", "codegen", {}),
    (r"hy-mt1\.5", "hunyuan_v1_dense", {}),
    (r"exaone-4\.0", "exaone4", {}),
    (r"nemotron-3-nano", "nemotron_h", {}),
    (r"glm-4-9b-chat-hf", "glm4", {}),
    (r"chatglm|glm-4-9b", "chatglm", {}),  # THUDM's glm-4-9b-chat is remote code (model_type chatglm)
    (r"internlm", "internlm", {}),
    (r"baichuan", "baichuan", {}),
    (r"elm-270m", "openelm", {}),
)


def resolve_base(name: str | None) -> tuple[str | None, dict[str, Any]]:
    """(model_type, features) of the base an adapter names; (None, {}) when the name says nothing
    (`base_model`, a bare local directory)."""
    if not isinstance(name, str):
        return None, {}
    low = name.lower()
    for pattern, model_type, features in BASE_TABLE:
        if re.search(pattern, low):
            return model_type, dict(features)
    return None, {}
