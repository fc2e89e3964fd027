"""Per-request token sampling: greedy, temperature, top-k, top-p, seeded.

Stateless: the random stream for token k of a request is derived from
(seed, k), so a request recomputed after preemption or an engine restart
draws the same tokens. Logprobs are of the chosen token under the model's
unmodified distribution.
"""
from __future__ import annotations

import torch

from loraplex.ipc.engine_plan import SamplingSpec

_MASK64 = (1 << 64) - 1


def stream_seed(seed: int, index: int) -> int:
    """splitmix64 of (seed, index): independent streams for consecutive tokens."""
    z = (seed * 0x9E3779B97F4A7C15 + (index + 1) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


def _filtered_probs(logits: torch.Tensor, spec: SamplingSpec) -> torch.Tensor:
    # logits: [vocab] float32
    scaled = logits / spec.temperature
    if 0 < spec.top_k < scaled.numel():
        kth = torch.topk(scaled, spec.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if spec.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        cumulative = torch.cumsum(sorted_probs, dim=-1)
        drop = cumulative - sorted_probs >= spec.top_p  # keep the smallest prefix reaching top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        probs = probs / probs.sum()
    return probs


def sample(logits: torch.Tensor, specs: list[SamplingSpec], indices: list[int]) -> tuple[list[int], list[float]]:
    """logits: [S, vocab] float32 -> chosen token ids and their logprobs."""
    logprobs = torch.log_softmax(logits, dim=-1)
    greedy = torch.argmax(logits, dim=-1).tolist()
    tokens: list[int] = []
    for row, spec in enumerate(specs):
        if spec.temperature == 0.0 or spec.top_k == 1:
            tokens.append(greedy[row])
            continue
        probs = _filtered_probs(logits[row], spec).cpu()
        gen = torch.Generator(device="cpu").manual_seed(stream_seed(spec.seed, indices[row]))
        tokens.append(int(torch.multinomial(probs, 1, generator=gen).item()))
    chosen = torch.tensor(tokens, dtype=torch.int64, device=logits.device)
    picked = logprobs.gather(1, chosen[:, None])[:, 0].tolist()
    return tokens, picked
