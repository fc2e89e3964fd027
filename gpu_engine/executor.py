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
from loraplex.gpu_engine.lora.merge import MergeController
from loraplex.gpu_engine.adapter_loader import AdapterLoader, GroupLoad
from loraplex.gpu_engine.lora.torch_backend import LoraGroup, ResidentLora, resident_lora
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
                 device: torch.device, dtype: torch.dtype, lora_backend: str = "torch",
                 load_throttle_bytes_s: float | None = None) -> None:
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
        self.merge = MergeController(weights, lambda name: self.host[name].adapter)  # dLoRA merged mode
        self.host: dict[str, HostEntry] = {}
        self.resident: dict[str, ResidentLora] = {}
        self.loader = AdapterLoader(self.pool, throttle_bytes_per_s=load_throttle_bytes_s)
        self.loads: dict[str, GroupLoad] = {}  # adapters whose layer groups may still be arriving
        self.cpu_assist = None  # CpuAssistEngine when CPU workers are attached (engine process)

    # ---- host store -------------------------------------------------------------------------
    def add_host_adapter(self, adapter: HostAdapter) -> AdapterLayout:
        layout = plan_adapter_layout(self.geometry, self.cfg.module_shapes(), adapter.spec.targets,
                                     adapter.spec.rank)
        self.host[adapter.name] = HostEntry(adapter, layout)
        return layout

    def rebind_host_adapter(self, adapter: HostAdapter) -> AdapterLayout:
        """The same content in new host memory (a restarted cache manager's store): the GPU
        copy stays; copies still reading the old memory finish first."""
        entry = self.host.get(adapter.name)
        if entry is None:
            return self.add_host_adapter(adapter)
        load = self.loads.pop(adapter.name, None)
        if load is not None:
            for layer_group in load.groups:
                load.wait_layer(layer_group.start)
        entry.adapter = adapter
        return entry.layout

    def remove_host_adapter(self, name: str) -> None:
        self.merge.forget(name)
        self._drop_resident(name)
        self.host.pop(name, None)

    def _drop_resident(self, name: str) -> None:
        load = self.loads.pop(name, None)
        if load is not None:
            for layer_group in load.groups:  # its pages may be reused at once: let the copies finish
                load.wait_layer(layer_group.start)
        self.resident.pop(name, None)

    # ---- execution --------------------------------------------------------------------------
    def execute(self, plan: StepPlan) -> StepResult:
        loaded_before = self.loader.started_bytes
        for name in plan.evict:
            self._drop_resident(name)
        for placement in plan.place:
            self._drop_resident(placement.name)
            entry = self.host[placement.name]
            resident = resident_lora(self.pool, entry.adapter, entry.layout, placement.pages)
            self.resident[placement.name] = resident
            self.loads[placement.name] = self.loader.start(entry.adapter, resident, placement.load_groups)
        rows = self.merge.prepare(plan)  # merged-mode rows run as base rows: their LoRA is in the weights
        if not rows:  # placements only (preloading)
            return StepResult(step_id=plan.step_id, rows=[],
                              transfer_bytes={"adapter_h2d": self.loader.started_bytes - loaded_before})
        t0 = time.perf_counter()
        # Rows sorted by adapter make each adapter one contiguous token segment (SGMV-style).
        ordered = sorted(rows, key=lambda r: (r.adapter is not None, r.adapter or ""))
        batch = self._build_batch(ordered, plan)
        logits = self.model.forward(batch, self.pool)
        # On CUDA the forward is only enqueued: the watchdog must follow the CPU sites before anything syncs.
        watchdog = batch.cpu.start_watchdog() if batch.cpu is not None else None
        t1 = time.perf_counter()
        sampled_rows = [r for r in ordered if r.sample]
        tokens, logprobs = sample(logits, [r.sampling for r in sampled_rows], [r.sample_index for r in sampled_rows])
        rows = [
            RowResult(request_id=r.request_id, token_id=t, logprob=lp if r.sampling.logprobs else None)
            for r, t, lp in zip(sampled_rows, tokens, logprobs)
        ]
        t2 = time.perf_counter()
        if watchdog is not None:
            watchdog.join()
        for name in [n for n, load in self.loads.items() if load.done()]:
            del self.loads[name]
        transfers = {"adapter_h2d": self.loader.started_bytes - loaded_before}
        if batch.cpu is not None:
            transfers["assist_d2h"] = batch.cpu.d2h_bytes
            transfers["assist_h2d"] = batch.cpu.h2d_bytes
        return StepResult(step_id=plan.step_id, rows=rows, forward_ms=(t1 - t0) * 1e3, sample_ms=(t2 - t1) * 1e3,
                          cpu_timeouts=batch.cpu.timeouts if batch.cpu is not None else 0,
                          load_wait_ms=batch.load_wait_ms, transfer_bytes=transfers)

    def _build_batch(self, rows: list[RowPlan], plan: StepPlan) -> ForwardBatch:
        token_ids: list[int] = []
        positions: list[int] = []
        page_ids: list[int] = []
        slots: list[int] = []
        spans: list[RowSpan] = []
        samples: list[int] = []
        segments: list[LoraGroup] = []
        cpu_rows: list[tuple[RowPlan, int, int]] = []
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
                last = segments[-1] if segments else None
                if last is not None and last.lora.name == row.adapter and last.cpu_layers == row.cpu_layers:
                    last.end += n
                else:
                    segments.append(LoraGroup(self.resident[row.adapter], first, first + n,
                                              cpu_layers=row.cpu_layers, load=self.loads.get(row.adapter)))
                if row.cpu_layers:
                    cpu_rows.append((row, first, n))

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
            cpu=self._cpu_run(plan, cpu_rows),
        )

    def _cpu_run(self, plan: StepPlan, cpu_rows: list[tuple[RowPlan, int, int]]):
        if plan.cpu is None or not cpu_rows:
            return None
        if self.cpu_assist is None:
            raise ValueError("the plan assigns rows to CPU workers but no CPU assist is attached to this engine")
        return self.cpu_assist.step(plan.cpu, [(row.cpu_row, first, n, row.cpu_layers, self.host[row.adapter].adapter)
                                               for row, first, n in cpu_rows])
