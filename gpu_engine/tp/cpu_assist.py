"""CPU-assisted prefill on a tensor-parallel engine: the model's post/collect calls
(gpu_engine/model/llama.py) on every rank, around rank 0's CpuAssistStepRun
(gpu_engine/cpu_assist.py), which alone talks to the CPU workers through the one
exchange, with the whole model's widths (the daemon still sees one engine).

- stages 0 and 2 (q/k/v and gate/up input, replicated on every rank): rank 0 posts x;
- stages 1 and 3 (o and down input, split by heads / intermediate): the CPU rows' x
  slices are gathered to rank 0 (tag "assist"), which posts them whole;
- column-parallel outputs (q/k/v, gate/up: each rank has out/N columns): rank 0 collects
  the whole deltas, then scatters column block j of the CPU rows to rank j (a fused
  qkv_proj / gate_up_proj: block j of each part, in order, as the rank's weights hold them);
- row-parallel outputs (o, down: already all-reduced, whole on every rank): rank 0
  collects the delta and broadcasts the CPU rows' to every rank.

Which rows are CPU rows at a layer, and which modules they target, come from the step
and the adapters' specs, the same on every rank; rank 0's timeout fallback changes only
where its deltas come from, never which collectives run, so the ranks never disagree.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from loraplex.gpu_engine.tp.comm import TpComm

REPLICATED_STAGES = (0, 2)  # x whole on every rank, outputs column-parallel
TAG = "assist"


@dataclass(frozen=True, slots=True)
class AssistRow:
    """Batch tokens [first, first + count) run on the CPU for layers [0, cpu_layers)."""

    first: int
    count: int
    cpu_layers: int
    targets: frozenset[str]


class TpCpuAssist:
    def __init__(self, comm: TpComm, inner, rows: list[AssistRow],
                 parts: dict[str, tuple[int, ...]] | None = None) -> None:
        """inner: rank 0's CpuAssistStepRun (None on the other ranks); rows: in the step's token order;
        parts: the whole out-features of each part of a fused column-parallel module
        (TensorParallelPlan.fused_parts); a module not named is one part."""
        if (inner is None) != (comm.rank != 0):
            raise ValueError(f"rank {comm.rank}: the CPU assist step run belongs to rank 0 only")
        self.comm = comm
        self.inner = inner
        self.rows = rows
        self.parts = parts or {}
        self._whole_x: dict[int, torch.Tensor] = {}  # rank 0: a split stage's input, gathered whole

    # what the executor reports (rank 0's reply is the engine's)
    @property
    def timeouts(self) -> int:
        return self.inner.timeouts if self.inner is not None else 0

    @property
    def d2h_bytes(self) -> int:
        return self.inner.d2h_bytes if self.inner is not None else 0

    @property
    def h2d_bytes(self) -> int:
        return self.inner.h2d_bytes if self.inner is not None else 0

    def start_watchdog(self):
        return self.inner.start_watchdog() if self.inner is not None else None

    def _active(self, layer: int) -> tuple[list[AssistRow], torch.Tensor | None]:
        rows = [r for r in self.rows if r.cpu_layers > layer]
        if not rows:
            return rows, None
        return rows, torch.cat([torch.arange(r.first, r.first + r.count) for r in rows])

    def post(self, layer: int, stage: int, x: torch.Tensor) -> None:
        rows, idx = self._active(layer)
        if not rows:
            return
        if stage in REPLICATED_STAGES:
            if self.inner is not None:
                self.inner.post(layer, stage, x)
            return
        idx = idx.to(x.device)
        gathered = self.comm.gather_last(x.index_select(0, idx), TAG)  # [CPU tokens, in] on rank 0
        if self.inner is None:
            return
        whole = x.new_zeros(x.shape[0], gathered.shape[1])
        whole.index_copy_(0, idx, gathered)
        self._whole_x[stage] = whole  # also what a timed-out site is computed from, at collect
        self.inner.post(layer, stage, whole)

    def collect(self, layer: int, stage: int, x: torch.Tensor, outs: dict[str, torch.Tensor]) -> None:
        rows, idx = self._active(layer)
        if not rows:
            return
        modules = [m for m in outs if any(m in r.targets for r in rows)]
        if stage in REPLICATED_STAGES:
            self._collect_columns(layer, stage, x, outs, modules, idx.to(x.device))
        else:
            self._collect_whole(layer, stage, outs, modules, idx.to(x.device))

    def _collect_columns(self, layer: int, stage: int, x: torch.Tensor, outs: dict[str, torch.Tensor],
                         modules: list[str], idx: torch.Tensor) -> None:
        """q/k/v or gate/up: every module's column block j of the CPU rows' deltas, in one scatter to rank j."""
        n = self.comm.world_size
        widths = [outs[m].shape[1] for m in modules]  # this rank's columns: out / N
        send = None
        if self.inner is not None:
            whole = {m: outs[m].new_zeros(x.shape[0], w * n) for m, w in zip(modules, widths)}
            self.inner.collect(layer, stage, x, whole)  # waits even when no module is targeted
            if modules:  # [C, N, w] per module -> rank j's block holds its columns of every module
                send = torch.cat([block for m in modules for block in self._rank_blocks(whole[m], idx, m)],
                                 dim=2).reshape(len(idx), -1)
        if not modules:
            return
        got = self.comm.scatter_last(send, outs[modules[0]].new_empty(len(idx), sum(widths)), TAG)
        offset = 0
        for m, w in zip(modules, widths):
            outs[m].index_add_(0, idx, got[:, offset: offset + w])
            offset += w

    def _rank_blocks(self, whole: torch.Tensor, idx: torch.Tensor, module: str) -> list[torch.Tensor]:
        """[C, N, part/N] per part of `module`'s whole delta rows: rank j's columns are block j of each."""
        n = self.comm.world_size
        rows = whole.index_select(0, idx)
        parts = self.parts.get(module, (whole.shape[1],))
        return [p.reshape(len(idx), n, p.shape[1] // n) for p in rows.split(list(parts), dim=1)]

    def _collect_whole(self, layer: int, stage: int, outs: dict[str, torch.Tensor], modules: list[str],
                       idx: torch.Tensor) -> None:
        """o or down: the output is already whole on every rank; rank 0's delta rows are broadcast."""
        widths = [outs[m].shape[1] for m in modules]
        delta = None
        if self.inner is not None:
            whole_x = self._whole_x.pop(stage)
            whole = {m: torch.zeros_like(outs[m]) for m in modules}
            self.inner.collect(layer, stage, whole_x, whole)
            if modules:
                delta = torch.cat([whole[m].index_select(0, idx) for m in modules], dim=1)
        if not modules:
            return
        if delta is None:
            delta = outs[modules[0]].new_empty(len(idx), sum(widths))
        self.comm.broadcast(delta, TAG)
        offset = 0
        for m, w in zip(modules, widths):
            outs[m].index_add_(0, idx, delta[:, offset: offset + w])
            offset += w
