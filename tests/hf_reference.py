"""Reference generation with transformers + PEFT, the ground truth the engine must match."""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import torch


@lru_cache(maxsize=8)
def _base(model_dir: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@lru_cache(maxsize=32)
def _with_adapter(model_dir: str, adapter_dir: str):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return PeftModel.from_pretrained(base, adapter_dir).eval()


def greedy(model_dir: Path, adapter_dir: Path | None, prompt: list[int], new_tokens: int
           ) -> tuple[list[int], list[float]]:
    """Greedy tokens and the chosen tokens' logprobs (full-sequence forward, float32)."""
    model = _base(str(model_dir)) if adapter_dir is None else _with_adapter(str(model_dir), str(adapter_dir))
    # A plain argmax loop: generate() would mask EOS under min_new_tokens and change the argmax.
    ids = torch.tensor([prompt])
    tokens: list[int] = []
    logprobs: list[float] = []
    with torch.no_grad():
        past = None
        step_input = ids
        for _ in range(new_tokens):
            out = model(step_input, past_key_values=past, use_cache=True)
            past = out.past_key_values
            logits = out.logits[0, -1].float()
            token = int(torch.argmax(logits))
            tokens.append(token)
            logprobs.append(float(torch.log_softmax(logits, dim=-1)[token]))
            step_input = torch.tensor([[token]])
    return tokens, logprobs


@lru_cache(maxsize=8)
def _float64(model_dir: str, adapter_dir: str | None):
    """The model (with the adapter, unmerged) in float64: a reference whose own rounding is
    negligible next to a float32 engine's."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64)
    if adapter_dir is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter_dir)
    return model.double().eval()


def prompt_logprobs(model_dir: Path, adapter_dir: Path | None, prompt: list[int]) -> torch.Tensor:
    """float64 log_softmax of every prompt position's logits [len(prompt), vocab] (one forward
    of the whole prompt): row p is the distribution of the token after position p."""
    model = _float64(str(model_dir), None if adapter_dir is None else str(adapter_dir))
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0].double()
    return torch.log_softmax(logits, dim=-1)
