"""The model executor: holds weights, the unified pool and the host adapter
store, and carries out StepPlans (place/evict adapters, run one forward,
sample). It makes no policy decision: which rows run and which pages they
use come from the plan.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from loraplex.daemon.memory.geometry import AdapterLayout, PageGeometry, plan_adapter_layout
from loraplex.gpu_engine.lora.peft_adapter import HostAdapter
from loraplex.gpu_engine.lora.backend import make_lora_backend
from loraplex.gpu_engine.lora.torch_backend import LoraGroup, ResidentLora, place_adapter
from loraplex.gpu_engine.model.config import ModelConfig
from loraplex.gpu_engine.model.batch import ForwardBatch, RowSpan
from loraplex.gpu_engine.model.llama import LlamaModel
from loraplex.gpu_engine.model.weights import ModelWeights
from loraplex.gpu_engine.pool import UnifiedPool
from loraplex.gpu_engine.sampler import sample
from loraplex.ipc.engine_plan import RowPlan, RowResult, StepPlan, StepResult


@dataclass(slots=True)
class HostEntry:
    adapter: HostAdapter
    layout: AdapterLayout


class Executor:
    def __init__(self, cfg: ModelConfig, weights: ModelWeights, geometry: PageGeometry, num_pages: int, *,
                 device: torch.device, dtype: torch.dtype, lora_backend: str = "torch") -> None:
        self.cfg = cfg
        self.device = device
        self.geometry = geometry
        self.pool = UnifiedPool(cfg.num_layers, num_pages, geometry, device=device, dtype=dtype)
        lora = make_lora_backend(lora_backend)
        attention = None
        if lora_backend == "triton":  # the Triton build runs paged attention through its kernels too
            from loraplex.gpu_engine.model.attention_triton import TritonPagedAttention

            attention = TritonPagedAttention(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.sliding_window)
        self.model = LlamaModel(cfg, weights, lora, attention=attention)
        self.host: dict[str, HostEntry] = {}
        self.resident: dict[str, ResidentLora] = {}

    # ---- host store -------------------------------------------------------------------------
    def add_host_adapter(self, adapter: HostAdapter) -> AdapterLayout:
        layout = plan_adapter_layout(self.geometry, self.cfg.module_shapes(), adapter.spec.targets,
                                     adapter.spec.rank)
        self.host[adapter.name] = HostEntry(adapter, layout)
        return layout

    def remove_host_adapter(self, name: str) -> None:
        self.host.pop(name, None)
        self.resident.pop(name, None)

    # ---- execution --------------------------------------------------------------------------
    def execute(self, plan: StepPlan) -> StepResult:
        for name in plan.evict:
            self.resident.pop(name, None)
        for placement in plan.place:
            entry = self.host[placement.name]
            self.resident[placement.name] = place_adapter(self.pool, entry.adapter, entry.layout, placement.pages)
        t0 = time.perf_counter()
        # Rows sorted by adapter make each adapter one contiguous token segment (SGMV-style).
        ordered = sorted(plan.rows, key=lambda r: (r.adapter is not None, r.adapter or ""))
        batch = self._build_batch(ordered)
        logits = self.model.forward(batch, self.pool)
        t1 = time.perf_counter()
        sampled_rows = [r for r in ordered if r.sample]
        tokens, logprobs = sample(logits, [r.sampling for r in sampled_rows], [r.sample_index for r in sampled_rows])
        rows = [
            RowResult(request_id=r.request_id, token_id=t, logprob=lp if r.sampling.logprobs else None)
            for r, t, lp in zip(sampled_rows, tokens, logprobs)
        ]
        t2 = time.perf_counter()
        return StepResult(step_id=plan.step_id, rows=rows, forward_ms=(t1 - t0) * 1e3, sample_ms=(t2 - t1) * 1e3)

    def _build_batch(self, rows: list[RowPlan]) -> ForwardBatch:
        token_ids: list[int] = []
        positions: list[int] = []
        page_ids: list[int] = []
        slots: list[int] = []
        spans: list[RowSpan] = []
        samples: list[int] = []
        segments: list[LoraGroup] = []
        pt = self.geometry.page_tokens
        for row in rows:
            first = len(token_ids)
            n = len(row.token_ids)
            context = row.start_pos + n
            if self.geometry.kv_pages_for(context) > len(row.kv_pages):
                raise ValueError(f"row {row.request_id}: {len(row.kv_pages)} pages cannot hold {context} tokens")
            token_ids += row.token_ids
            for pos in range(row.start_pos, context):
                positions.append(pos)
                page_ids.append(row.kv_pages[pos // pt])
                slots.append(pos % pt)
            spans.append(RowSpan(first=first, count=n, start_pos=row.start_pos, context=context,
                                 pages=torch.tensor(row.kv_pages[: self.geometry.kv_pages_for(context)],
                                                    dtype=torch.int64, device=self.device)))
            if row.sample:
                samples.append(first + n - 1)
            if row.adapter is not None:
                if row.adapter not in self.resident:
                    raise ValueError(f"row {row.request_id}: adapter {row.adapter!r} is not placed in the pool")
                if segments and segments[-1].lora.name == row.adapter:
                    segments[-1].end += n
                else:
                    segments.append(LoraGroup(self.resident[row.adapter], first, first + n))

        def as_tensor(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64, device=self.device)

        return ForwardBatch(
            token_ids=as_tensor(token_ids),
            positions=as_tensor(positions),
            kv_page_ids=as_tensor(page_ids),
            kv_slots=as_tensor(slots),
            rows=spans,
            sample_tokens=as_tensor(samples),
            lora_groups=segments,
        )
