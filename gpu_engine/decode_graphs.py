"""CUDA-graph capture and replay of decode steps.

Owns the batch-size buckets, the static buffers a decode forward reads (token ids,
positions, K/V write targets, paged-attention row tables, LoRA slot tables), the
padding of a decode batch up to its bucket, and the captured graphs. Padding rows are
base rows whose K/V go to a scratch page no sequence owns; their logits are dropped.
Where graphs cannot run (CPU, the torch LoRA backend, disabled) the same padding and
buffers feed an eager forward. Makes no scheduling decision and never syncs mid-step.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from loraplex.gpu_engine.lora.torch_backend import LoraGroup, ResidentLora
from loraplex.gpu_engine.model.batch import ForwardBatch, RowSpan
from loraplex.gpu_engine.model.llama import LlamaModel
from loraplex.gpu_engine.pool import UnifiedPool
from loraplex.ipc.engine_plan import RowPlan

WARMUP_RUNS = 2  # eager runs before each capture: Triton compiles, the caching allocator settles


def bucket_sizes(max_batch: int) -> tuple[int, ...]:
    """1, 2, 4, ... below max_batch, then max_batch itself."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    sizes = []
    b = 1
    while b < max_batch:
        sizes.append(b)
        b *= 2
    return (*sizes, max_batch)


@dataclass(frozen=True, slots=True)
class DecodeGraphInfo:
    """What the engine reports: whether decode steps replay graphs, and for which batch sizes."""

    enabled: bool
    buckets: tuple[int, ...]  # captured batch sizes; empty when eager
    reason: str = ""  # why decode steps run eagerly; empty when graphs are on

    def as_dict(self) -> dict[str, object]:
        return {"cuda_graphs": self.enabled, "graph_buckets": list(self.buckets), "graph_reason": self.reason}


def graph_blocker(model: LlamaModel, device: torch.device, enabled: bool) -> str:
    """Why this engine cannot capture decode graphs, or "" when it can."""
    if not enabled:
        return "disabled (cuda_graphs=false)"
    if device.type != "cuda":
        return f"device {device.type}: CUDA graphs need a CUDA device"
    if not _static_capable(model):
        return "the torch LoRA backend has data-dependent shapes; use lora_backend='triton'"
    return ""


def _static_capable(model: LlamaModel) -> bool:
    """Both the LoRA backend and the attention can read prebuilt, capacity-sized metadata."""
    from loraplex.gpu_engine.model.attention_torch import TorchPagedAttention

    return hasattr(model.lora, "pin") and not isinstance(model.attention, TorchPagedAttention)


@dataclass(slots=True)
class _Bucket:
    size: int
    batch: ForwardBatch  # views of the runner's buffers
    lora_step: object | None  # the Triton backend's static step (None with the torch backend)
    graph: object | None = None  # torch.cuda.CUDAGraph once captured
    logits: torch.Tensor | None = None  # the graph's output buffer [size, vocab]


@dataclass(slots=True)
class _Padded:
    """Host values of one step's rows, padded to the bucket (pad rows: token 0 at position 0,
    K/V into slot 0 of the scratch page, attending to that one key)."""

    tokens: list[list[int]]  # [4][bucket]: token id, position, K/V page, K/V slot
    start_pos: list[int]  # [bucket]
    context: list[int]  # [bucket]
    pages: list[list[int]]  # [bucket][pages]: each row's page table


class DecodeGraphRunner:
    def __init__(self, model: LlamaModel, pool: UnifiedPool, *, max_batch: int, max_model_len: int,
                 max_lora_rank: int, scratch_page: int) -> None:
        if not 0 <= scratch_page < pool.num_pages:
            raise ValueError(f"scratch page {scratch_page} is outside the pool's {pool.num_pages} pages")
        self.model = model
        self.pool = pool
        self.geometry = pool.geometry
        self.device = pool.data.device
        self.max_model_len = max_model_len
        self.max_lora_rank = max_lora_rank
        self.scratch_page = scratch_page
        self.static = _static_capable(model)
        self.sizes = bucket_sizes(max_batch)
        cap = self.sizes[-1]
        self.max_pages = self.geometry.kv_pages_for(max_model_len)
        dev = self.device
        i32 = dict(dtype=torch.int32, device=dev)
        self.tokens = torch.zeros(4, cap, dtype=torch.int64, device=dev)  # ids, positions, K/V pages, K/V slots
        self.sample_tokens = torch.arange(cap, dtype=torch.int64, device=dev)
        self.q_start = torch.arange(cap, **i32)
        self.q_len = torch.ones(cap, **i32)  # pad rows are live one-token rows too: no garbage flows on
        self.rows = torch.zeros(2, cap, **i32)  # start_pos, context
        self.page_table = torch.full((cap, self.max_pages), scratch_page, **i32)
        shared = None
        if self.static:
            shared = model.lora.static_step(cap, cap, max_lora_rank, list(model.cfg.module_shapes()), dev)
        self.buckets = [self._bucket(b, shared) for b in self.sizes]
        self.graph_pool = None  # memory pool shared by every bucket's graph
        self.replays = 0

    # ---- buckets ----------------------------------------------------------------------------
    def _bucket(self, size: int, shared: object | None) -> _Bucket:
        step = rows = None
        if shared is not None:  # the Triton build: capacity-sized LoRA tables and attention rows
            from loraplex.kernels.paged_kv import PagedRows

            step = self.model.lora.static_step(size, 0, 0, [], self.device, share=shared)
            # max_context is the capacity: the attention grid never depends on this step's contexts
            rows = PagedRows(self.q_start[:size], self.q_len[:size], self.rows[0, :size], self.rows[1, :size],
                             self.page_table[:size], max_q_len=1, max_context=self.max_model_len)
        # The placeholder group keeps every LoRA launch in the step: the pinned tables decide who has one.
        placeholder = [LoraGroup(ResidentLora("<decode-graph>", 0, 1.0, {}, {}), 0, size)] if self.static else []
        batch = ForwardBatch(token_ids=self.tokens[0, :size], positions=self.tokens[1, :size],
                             kv_page_ids=self.tokens[2, :size], kv_slots=self.tokens[3, :size], rows=[],
                             sample_tokens=self.sample_tokens[:size], lora_groups=placeholder,
                             decode_rows=rows)
        return _Bucket(size, batch, step)

    def bucket_for(self, n: int) -> _Bucket | None:
        for bucket in self.buckets:
            if bucket.size >= n:
                return bucket
        return None

    @property
    def captured(self) -> tuple[int, ...]:
        return tuple(b.size for b in self.buckets if b.graph is not None)

    def accepts(self, rows: Sequence[RowPlan], loras: Sequence[ResidentLora | None]) -> bool:
        """A decode batch that fits a bucket: one token per row, context within capacity, no CPU-run
        layers, adapter ranks within the static tables."""
        if not rows or len(rows) > self.sizes[-1]:
            return False
        for row, lora in zip(rows, loras):
            if len(row.token_ids) != 1 or row.cpu_layers or row.start_pos + 1 > self.max_model_len:
                return False
            if self.geometry.kv_pages_for(row.start_pos + 1) > len(row.kv_pages):
                return False
            if lora is not None and lora.rank > self.max_lora_rank:
                return False
        return True

    # ---- a step -------------------------------------------------------------------------------
    def run(self, rows: Sequence[RowPlan], loras: Sequence[ResidentLora | None]) -> torch.Tensor:
        """Logits [len(rows), vocab] float32 of a decode batch, rows ordered so that each adapter is
        one contiguous run (as the executor orders them); replays the bucket's graph when captured."""
        if not self.accepts(rows, loras):
            raise ValueError(f"not a decode batch this runner accepts ({len(rows)} rows)")
        bucket = self.bucket_for(len(rows))
        if bucket is None:  # unreachable: accepts() checked the size
            raise ValueError(f"no bucket holds {len(rows)} rows")
        padded = self._pad(rows, bucket.size)
        self._upload(padded, bucket.size)
        groups = _segments(loras)
        if bucket.lora_step is not None:
            self.model.lora.fill_static(bucket.lora_step, groups)
        if bucket.graph is not None:
            bucket.graph.replay()
            self.replays += 1
            logits = bucket.logits
        else:
            logits = self._eager(bucket, padded, groups)
        return logits[: len(rows)]

    def _pad(self, rows: Sequence[RowPlan], size: int) -> _Padded:
        pt, scratch, pad = self.geometry.page_tokens, self.scratch_page, size - len(rows)
        ids, pos = [r.token_ids[0] for r in rows], [r.start_pos for r in rows]
        kv_pages = [r.kv_pages[p // pt] for r, p in zip(rows, pos)]
        pages = [r.kv_pages[: self.geometry.kv_pages_for(p + 1)] for r, p in zip(rows, pos)]
        return _Padded(tokens=[ids + [0] * pad, pos + [0] * pad, kv_pages + [scratch] * pad,
                               [p % pt for p in pos] + [0] * pad],
                       start_pos=pos + [0] * pad, context=[p + 1 for p in pos] + [1] * pad,
                       pages=pages + [[scratch]] * pad)

    def _upload(self, padded: _Padded, size: int) -> None:
        """Host values into the static buffers: three copies per step, none inside the graph."""
        width = max(len(p) for p in padded.pages)
        table = [p + [self.scratch_page] * (width - len(p)) for p in padded.pages]
        self.tokens[:, :size].copy_(torch.tensor(padded.tokens, dtype=torch.int64))
        self.rows[:, :size].copy_(torch.tensor([padded.start_pos, padded.context], dtype=torch.int32))
        # Columns past a row's context are never read: only this step's width is refreshed.
        self.page_table[:size, :width].copy_(torch.tensor(table, dtype=torch.int32))

    def _eager(self, bucket: _Bucket, padded: _Padded, groups: list[LoraGroup]) -> torch.Tensor:
        batch = bucket.batch
        batch.load_wait_ms = 0.0
        if bucket.lora_step is not None:
            self.model.lora.pin(bucket.lora_step)
            try:
                return self.model.forward(batch, self.pool)
            finally:
                self.model.lora.pin(None)
        # Torch backend and attention: per-row spans and the real adapter segments (pad rows come
        # last, so the segments' token ranges are those of the unpadded step).
        spans = [RowSpan(first=i, count=1, start_pos=s, context=c,
                         pages=torch.tensor(p, dtype=torch.int64, device=self.device))
                 for i, (s, c, p) in enumerate(zip(padded.start_pos, padded.context, padded.pages))]
        eager = ForwardBatch(token_ids=batch.token_ids, positions=batch.positions, kv_page_ids=batch.kv_page_ids,
                             kv_slots=batch.kv_slots, rows=spans, sample_tokens=batch.sample_tokens,
                             lora_groups=groups)
        return self.model.forward(eager, self.pool)

    # ---- capture ------------------------------------------------------------------------------
    def capture(self) -> None:
        """Warm up and capture every bucket, largest first so the smaller graphs reuse its memory
        from the shared pool. Pad-only batches: the captures touch nothing but the scratch page."""
        if self.device.type != "cuda" or not self.static:
            raise ValueError("decode graphs are captured only on CUDA with the Triton LoRA backend")
        self.graph_pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream(device=self.device)
        for bucket in reversed(self.buckets):
            self._upload(self._pad([], bucket.size), bucket.size)
            self.model.lora.fill_static(bucket.lora_step, [])
            self.model.lora.pin(bucket.lora_step)
            try:
                side.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(side):
                    for _ in range(WARMUP_RUNS):
                        self.model.forward(bucket.batch, self.pool)
                torch.cuda.current_stream(self.device).wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                # thread_local: adapter-copy threads may use their own streams while this thread captures
                with torch.cuda.graph(graph, pool=self.graph_pool, capture_error_mode="thread_local"):
                    logits = self.model.forward(bucket.batch, self.pool)
            finally:
                self.model.lora.pin(None)
            bucket.graph, bucket.logits = graph, logits
        torch.cuda.synchronize(self.device)


def _segments(loras: Sequence[ResidentLora | None]) -> list[LoraGroup]:
    """Contiguous runs of one adapter as token segments (rows are one token each)."""
    groups: list[LoraGroup] = []
    for i, lora in enumerate(loras):
        if lora is None:
            continue
        if groups and groups[-1].lora is lora and groups[-1].end == i:
            groups[-1].end += 1
        else:
            groups.append(LoraGroup(lora, i, i + 1))
    return groups
