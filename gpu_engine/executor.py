"""The model executor: holds weights, the unified pool and the host adapter
store, and carries out StepPlans (place/evict adapters, run one forward,
sample). It makes no policy decision: which rows run and which pages they
use come from the plan. Decode steps that fit a captured bucket replay a CUDA
graph (gpu_engine.decode_graphs); every other step runs the forward eagerly.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from loraplex.contracts.geometry import AdapterLayout, PageGeometry
from loraplex.gpu_engine.adapter_loader import AdapterLoader, GroupLoad
from loraplex.gpu_engine.decode_graphs import DecodeGraphInfo, DecodeGraphRunner, graph_blocker
from loraplex.gpu_engine.lora.merge import MergeController
from loraplex.gpu_engine.lora.peft_adapter import HostAdapter
from loraplex.gpu_engine.lora.torch_backend import LoraGroup, ResidentLora, resident_lora
from loraplex.gpu_engine.model.batch import ForwardBatch, RowSpan
from loraplex.gpu_engine.model.config import ModelConfig
from loraplex.gpu_engine.model.weights import ModelWeights
from loraplex.gpu_engine.model_split import ModelSplit, WholeModel
from loraplex.gpu_engine.pool import UnifiedPool
from loraplex.gpu_engine.prompt_logprobs import ScoredRow, score, scored_positions
from loraplex.gpu_engine.sampler import Sampler
from loraplex.gpu_engine.tp.cpu_assist import AssistRow
from loraplex.ipc.engine_plan import RowPlan, StepPlan, StepResult


@dataclass(slots=True)
class HostEntry:
    adapter: HostAdapter  # whole (on a tensor-parallel rank too: the merge slices come from it)
    layout: AdapterLayout
    pool_copy: HostAdapter  # what the pool pages hold: the adapter, or this rank's shard of it


class Executor:
    def __init__(self, cfg: ModelConfig, weights: ModelWeights, geometry: PageGeometry, num_pages: int, *,
                 device: torch.device, dtype: torch.dtype, lora_backend: str = "torch",
                 load_throttle_bytes_s: float | None = None, split: ModelSplit | None = None,
                 packed_weights: bool = False) -> None:
        """weights: what `split` runs (a tensor-parallel rank's shard, split.shard_weights); split: how the
        model is split over devices (default: one device); packed_weights: model.cpu_packed_weights."""
        self.cfg = cfg
        self.device = device
        self.geometry = geometry
        self.split = split or WholeModel(cfg)
        # One page past those the allocator hands out: padding rows of decode-graph buckets write
        # their K/V there, so no sequence's page is ever touched by them.
        self.pool = UnifiedPool(cfg.num_layers, num_pages + 1, geometry, device=device, dtype=dtype)
        self.scratch_page = num_pages
        self.model = self.split.build_model(weights, lora_backend, packed_weights=packed_weights)
        # dLoRA merged mode: each rank adds its slice of s·B·A into its own weight shard
        self.merge = MergeController(weights, lambda name: self.split.merge_copy(self.host[name].adapter))
        self.host: dict[str, HostEntry] = {}
        self.resident: dict[str, ResidentLora] = {}
        self.loader = AdapterLoader(self.pool, throttle_bytes_per_s=load_throttle_bytes_s)
        self.loads: dict[str, GroupLoad] = {}  # adapters whose layer groups may still be arriving
        self.cpu_assist = None  # CpuAssistEngine when CPU workers are attached (engine process)
        self.graphs: DecodeGraphRunner | None = None
        self.graph_info = DecodeGraphInfo(enabled=False, buckets=(), reason="not set up")
        self.bucket_steps = 0  # decode steps run through the bucket runner (replayed or padded eager)
        self.sampler = Sampler(cfg.vocab_size, cfg.eos_token_ids)

    def setup_decode_graphs(self, *, max_batch: int, max_model_len: int, max_lora_rank: int, enabled: bool = True,
                            pad_eager: bool = False) -> DecodeGraphInfo:
        """Capture decode steps of up to max_batch rows where this engine can (CUDA, Triton backend,
        enabled). pad_eager: route decode steps through the padded buckets even without graphs
        (the same buffers, run eagerly; for tests on CPU)."""
        reason = graph_blocker(self.model, self.device, enabled)
        if self.split.world_size > 1:  # the buckets' static buffers know nothing of the collectives yet
            reason, pad_eager = "tensor parallelism: decode runs eagerly (graphs of NCCL steps not built)", False
        self.graphs = None
        if not reason or pad_eager:
            self.graphs = DecodeGraphRunner(self.model, self.pool, max_batch=max_batch, max_model_len=max_model_len,
                                            max_lora_rank=max_lora_rank, scratch_page=self.scratch_page)
            if not reason:
                self.graphs.capture()
        self.graph_info = DecodeGraphInfo(enabled=not reason, buckets=self.graphs.captured if self.graphs else (),
                                          reason=reason)
        return self.graph_info

    # ---- host store -------------------------------------------------------------------------
    def add_host_adapter(self, adapter: HostAdapter) -> AdapterLayout:
        layout = self.split.plan.adapter_layout(self.geometry, adapter.spec.targets, adapter.spec.rank)
        self.host[adapter.name] = HostEntry(adapter, layout, self.split.pool_copy(adapter))
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
        entry.pool_copy = self.split.pool_copy(adapter)
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
        if plan.grammars and self.split.samples:  # compiled off the step; the result says when (grammars_ready)
            self.sampler.compile_ahead(plan.grammars)
        for name in plan.evict:
            self._drop_resident(name)
        for placement in plan.place:
            self._drop_resident(placement.name)
            entry = self.host[placement.name]
            resident = resident_lora(self.pool, entry.pool_copy, entry.layout, placement.pages)
            self.resident[placement.name] = resident
            self.loads[placement.name] = self.loader.start(entry.pool_copy, resident, placement.load_groups)
        rows = self.merge.prepare(plan)  # merged-mode rows run as base rows: their LoRA is in the weights
        if not rows:  # placements only (preloading)
            return StepResult(step_id=plan.step_id, rows=[], loading=self._still_loading(),
                              grammars_ready=self.sampler.grammars_ready(),
                              transfer_bytes={"adapter_h2d": self.loader.started_bytes - loaded_before})
        t0 = time.perf_counter()
        # Rows sorted by adapter make each adapter one contiguous token segment (SGMV-style).
        ordered = sorted(rows, key=lambda r: (r.adapter is not None, r.adapter or ""))
        sampled_rows = [r for r in ordered if r.sample]
        loras = self._graph_loras(ordered, plan)
        batch = None
        if loras is not None:
            logits = self.graphs.run(ordered, loras)  # [rows, vocab]: one token per row
            self.bucket_steps += 1
            if len(sampled_rows) != len(ordered):
                keep = [i for i, r in enumerate(ordered) if r.sample]
                logits = logits[torch.tensor(keep, dtype=torch.int64, device=logits.device)]
        else:
            batch = self._build_batch(ordered, plan)
            scored, targets = self._scoring(ordered)
            if scored:
                batch.score_tokens = self._tensor([i for r in scored for i in range(r.first, r.first + r.count)])
            batch.sample_heads = self._head_segments([(r.adapter, int(r.sample)) for r in ordered])
            logits = self.model.forward(batch, self.pool)
        cpu = batch.cpu if batch is not None else None
        # On CUDA the forward is only enqueued: the watchdog must follow the CPU sites before anything syncs.
        watchdog = cpu.start_watchdog() if cpu is not None else None
        t1 = time.perf_counter()
        # A tensor-parallel rank other than 0 has no logits: rank 0 samples and replies for the group.
        rows = self.sampler.sample(logits, ordered, sampled_rows) if self.split.samples else []
        prompt = []
        if batch is not None and batch.scored_hidden is not None:  # every rank: the LM head may be a collective
            heads = self._head_segments([(r.adapter, max(r.prompt_scored, 0)) for r in ordered])

            def logits_of(hidden: torch.Tensor, start: int) -> torch.Tensor | None:
                end = start + hidden.shape[0]
                chunk = [(max(a, start) - start, min(b, end) - start, lora)
                         for a, b, lora in heads if a < end and b > start]
                return self.model.logits(hidden, self.pool, chunk)

            prompt = score(logits_of, batch.scored_hidden, self._tensor(targets), scored, self.cfg.vocab_size)
        t2 = time.perf_counter()
        if watchdog is not None:
            watchdog.join()
        loading = self._still_loading()
        transfers = {"adapter_h2d": self.loader.started_bytes - loaded_before}
        if cpu is not None:
            transfers["assist_d2h"] = cpu.d2h_bytes
            transfers["assist_h2d"] = cpu.h2d_bytes
        return StepResult(step_id=plan.step_id, rows=rows, forward_ms=(t1 - t0) * 1e3, sample_ms=(t2 - t1) * 1e3,
                          cpu_timeouts=cpu.timeouts if cpu is not None else 0,
                          load_wait_ms=batch.load_wait_ms if batch is not None else 0.0, transfer_bytes=transfers,
                          loading=loading, grammars_ready=self.sampler.grammars_ready(), prompt_logprobs=prompt)

    def _still_loading(self) -> list[str]:
        """Forget finished loads; the adapters whose layer groups are still arriving."""
        for name in [n for n, load in self.loads.items() if load.done()]:
            del self.loads[name]
        return list(self.loads)

    def _graph_loras(self, rows: list[RowPlan], plan: StepPlan) -> list[ResidentLora | None] | None:
        """Each row's placed adapter when the step can run through the decode buckets, else None:
        decode rows only, no CPU-run layers, and no adapter whose layer groups are still arriving
        (those steps overlap compute with the copies, layer by layer, which a replay cannot)."""
        if self.graphs is None or (plan.cpu is not None and any(r.cpu_layers for r in rows)) \
                or any(r.prompt_scored for r in rows) or self.merge.untied:
            return None  # prompt logprobs need more than one position's logits
        loras: list[ResidentLora | None] = []
        for row in rows:
            if row.adapter is None:
                loras.append(None)
                continue
            lora = self.resident.get(row.adapter)
            load = self.loads.get(row.adapter)
            if lora is None or (load is not None and not load.done()) or lora.heads:
                return None  # unplaced adapters take the eager path, which explains the error; and LoRA
                # on the embedding or the LM head is applied outside the captured layers' kernels
            loras.append(lora)
        return loras if self.graphs.accepts(rows, loras) else None

    def _head_segments(self, counts: list[tuple[str | None, int]]) -> list[tuple[int, int, ResidentLora]]:
        """Where LoRA on the LM head applies in a list of rows' outputs, where row i (its adapter,
        and how many outputs it has there: 1 sampled, or its scored positions) takes counts[i]:
        (first, end, adapter) for each run of outputs of an adapter adapting lm_head."""
        segments: list[tuple[int, int, ResidentLora]] = []
        at = 0
        for adapter, n in counts:
            lora = self.resident.get(adapter) if adapter is not None else None
            if n and lora is not None and "lm_head" in lora.heads:
                if segments and segments[-1][2] is lora and segments[-1][1] == at:
                    segments[-1] = (segments[-1][0], at + n, lora)
                else:
                    segments.append((at, at + n, lora))
            at += n
        return segments

    def _tensor(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=self.device)

    @staticmethod
    def _scoring(rows: list[RowPlan]) -> tuple[list[ScoredRow], list[int]]:
        """The step's prompt-logprob positions (rows in step order) and the prompt token each scores."""
        scored: list[ScoredRow] = []
        targets: list[int] = []
        first = 0
        for row in rows:
            found = scored_positions(row, first)
            if found is not None:
                scored.append(found[0])
                targets += found[1]
            first += len(row.token_ids)
        return scored, targets

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
        """The step's CpuAssistStepRun (rank 0 of a tensor-parallel engine: wrapped, as on every rank)."""
        if plan.cpu is None or not cpu_rows:
            return None
        inner = None
        if self.cpu_assist is not None:  # one device, or rank 0: the engine's exchange
            inner = self.cpu_assist.step(plan.cpu, [(row.cpu_row, first, n, row.cpu_layers,
                                                     self.host[row.adapter].adapter) for row, first, n in cpu_rows])
        return self.split.assist_step(inner, [AssistRow(first, n, row.cpu_layers,
                                                        frozenset(self.host[row.adapter].adapter.spec.targets))
                                              for row, first, n in cpu_rows])
