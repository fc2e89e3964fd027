"""A ForwardBatch of whole rows on pages given up front, for tests and benchmarks
that drive a model without a scheduler (the engine builds its steps from plans,
gpu_engine/executor.py). One token is sampled per row; consecutive rows of one
adapter form one LoRA segment."""
from __future__ import annotations

import torch

from loraplex.contracts.geometry import PageGeometry
from loraplex.gpu_engine.lora.torch_backend import LoraGroup, ResidentLora
from loraplex.gpu_engine.model.batch import ForwardBatch, RowSpan

# (token ids, position of the first, the row's KV pages, its placed adapter or None)
Row = tuple[list[int], int, list[int], ResidentLora | None]


def whole_rows_batch(rows: list[Row], geometry: PageGeometry) -> ForwardBatch:
    tokens: list[int] = []
    positions: list[int] = []
    page_ids: list[int] = []
    slots: list[int] = []
    spans: list[RowSpan] = []
    samples: list[int] = []
    groups: list[LoraGroup] = []
    pt = geometry.page_tokens
    for ids, start, pages, lora in rows:
        first = len(tokens)
        context = start + len(ids)
        if geometry.kv_pages_for(context) > len(pages):
            raise ValueError(f"{len(pages)} pages cannot hold {context} tokens")
        tokens += ids
        positions += range(start, context)
        page_ids += [pages[p // pt] for p in range(start, context)]
        slots += [p % pt for p in range(start, context)]
        spans.append(RowSpan(first=first, count=len(ids), start_pos=start, context=context,
                             pages=torch.tensor(pages[: geometry.kv_pages_for(context)], dtype=torch.int64)))
        samples.append(first + len(ids) - 1)
        if lora is not None:
            if groups and groups[-1].lora is lora and groups[-1].end == first:
                groups[-1].end += len(ids)
            else:
                groups.append(LoraGroup(lora, first, first + len(ids)))

    def as_tensor(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64)

    return ForwardBatch(token_ids=as_tensor(tokens), positions=as_tensor(positions), kv_page_ids=as_tensor(page_ids),
                        kv_slots=as_tensor(slots), rows=spans, sample_tokens=as_tensor(samples), lora_groups=groups)
