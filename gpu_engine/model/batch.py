"""The tensors of one continuous-batching step as the model sees them: flattened
tokens of all rows, where their K/V go, each row's span and page table, and
the adapter segments."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from loraplex.gpu_engine.lora.torch_backend import LoraGroup, ResidentLora


@dataclass(slots=True)
class RowSpan:
    """One sequence's tokens in the flattened step: tokens[first:first+count] sit at
    positions start_pos..; after this step its KV covers `context` tokens."""

    first: int
    count: int
    start_pos: int
    context: int
    pages: torch.Tensor  # [pages] int64


@dataclass(slots=True)
class ForwardBatch:
    token_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    kv_page_ids: torch.Tensor  # [T] page receiving each token's K/V
    kv_slots: torch.Tensor  # [T] slot inside that page
    rows: list[RowSpan]
    sample_tokens: torch.Tensor  # [S] indices of tokens whose logits are needed
    lora_groups: list[LoraGroup]
    cpu: object | None = None  # CpuAssistStepRun when some rows' LoRA runs on the CPU workers
    load_wait_ms: float = 0.0
    # PagedRows in a decode-graph runner's static buffers, sized from capacity: the Triton attention
    # reads them instead of building row metadata from `rows` (which may then be empty).
    decode_rows: object | None = None
    # Prompt logprobs: tokens whose final (normed) hidden states the forward keeps in
    # `scored_hidden` [P, hidden] for gpu_engine/prompt_logprobs.py; None: no row asked.
    score_tokens: torch.Tensor | None = None  # [P]
    scored_hidden: torch.Tensor | None = None
    # LoRA on the LM head: (first, end, adapter) of the sampled rows (of sample_tokens) per adapter
    # whose LoRA adapts lm_head; () when none does.
    sample_heads: list[tuple[int, int, ResidentLora]] = field(default_factory=list)
