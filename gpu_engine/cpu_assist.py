"""The engine's side of CPU-assisted prefill: per layer and stage,
hand the CPU-planned rows' activations to the worker processes through the
exchange segment, keep computing, then fold their LoRA deltas back in.

On CPU hosts the hand-over is a host copy plus a sequence-word store and wake,
and the wait is a host wait with a deadline. A site whose workers miss the
deadline is computed here from the host store instead (never wrong, never
hung) and counted, so the daemon can restart the stalled worker.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from loraplex import _C
from loraplex.gpu_engine.lora.peft_adapter import HostAdapter
from loraplex.ipc.engine_plan import CpuAssistStep
from loraplex.ipc.exchange import STAGES, ExchangeLayout, exchange_layout
from loraplex.ipc.shm import SharedSegment

DEFAULT_DEADLINE_MS = 2000


@dataclass(slots=True)
class CpuRow:
    """One row of the step on the CPU path: batch tokens [first, first+count) sit in
    exchange rows [xrow, xrow+count) for layers [0, cpu_layers)."""

    first: int
    count: int
    xrow: int
    cpu_layers: int
    adapter: HostAdapter

    def targets(self, module: str) -> bool:
        return module in self.adapter.spec.targets


class ExchangeBuffers:
    """Torch views over the exchange segment (float32 regions, 64-bit words)."""

    def __init__(self, layout: ExchangeLayout, segment: SharedSegment) -> None:
        self.layout = layout
        self.segment = segment
        self.words = segment.buf
        self.x = {stage: self._view(layout.x_region(stage)) for stage in range(len(STAGES))}
        self.out = {m: self._view(layout.out_region(m)) for m in layout.module_names}

    def _view(self, region) -> torch.Tensor:
        count = region.rows * region.cols
        flat = torch.frombuffer(self.segment.buf, dtype=torch.float32, count=count, offset=region.offset)
        return flat.view(region.rows, region.cols)


class CpuAssistStepRun:
    """The CPU side of one forward pass."""

    def __init__(self, buffers: ExchangeBuffers, seq: int, workers_per_layer: list[int], rows: list[CpuRow],
                 deadline_ms: int = DEFAULT_DEADLINE_MS) -> None:
        self.buf = buffers
        self.seq = seq
        self.workers = workers_per_layer
        self.rows = rows
        self.deadline_ms = deadline_ms
        self.timeouts = 0
        self.d2h_bytes = 0
        self.h2d_bytes = 0
        self._fallback = False  # after a timeout the rest of the step is computed here
        self._done_base: dict[int, int] = {}

    def active(self, layer: int) -> list[CpuRow]:
        return [r for r in self.rows if r.cpu_layers > layer]

    def start_watchdog(self) -> None:
        """Nothing to follow: on the host path every site was waited for inline."""
        return None

    def post(self, layer: int, stage: int, x: torch.Tensor) -> None:
        """x: [tokens, in] of the whole step; copy the CPU rows' slice out and signal the workers."""
        rows = self.active(layer)
        if not rows or self._fallback:
            return
        layout = self.buf.layout
        site = layer * 4 + stage
        self._done_base[site] = _C.atomic_load(self.buf.words, layout.done_word(site))
        xbuf = self.buf.x[stage]
        for r in rows:
            xbuf[r.xrow:r.xrow + r.count].copy_(x[r.first:r.first + r.count])
            self.d2h_bytes += r.count * x.shape[1] * 4
        _C.store_and_wake(self.buf.words, layout.ready_word(site), self.seq)

    def collect(self, layer: int, stage: int, x: torch.Tensor, outs: dict[str, torch.Tensor]) -> None:
        """Wait for the workers' deltas of this site and add them into `outs` (module -> [tokens, out])."""
        rows = self.active(layer)
        if not rows:
            return
        site = layer * 4 + stage
        if not self._fallback:
            target = self._done_base[site] + self.workers[layer]
            word = self.buf.layout.done_word(site)
            if _C.wait_until_at_least(self.buf.words, word, target, self.deadline_ms):
                for module, out in outs.items():
                    delta = self.buf.out[module]
                    for r in rows:
                        if r.targets(module):
                            out[r.first:r.first + r.count] += delta[r.xrow:r.xrow + r.count].to(out.dtype)
                            self.h2d_bytes += r.count * out.shape[1] * 4
                return
            self.timeouts += 1
            self._fallback = True
            # Tell the workers this step is abandoned, so none of them keeps writing into the exchange.
            _C.add_and_wake(self.buf.words, self.buf.layout.control_word, 1)
        for module, out in outs.items():
            for r in rows:
                if r.targets(module):
                    a = r.adapter.a[layer][module].to(torch.float32)
                    b = r.adapter.b[layer][module].to(torch.float32)
                    xs = x[r.first:r.first + r.count].to(torch.float32)
                    out[r.first:r.first + r.count] += ((xs @ a.t()) @ b.t() * r.adapter.spec.scaling).to(out.dtype)


class CpuAssistEngine:
    """Owns the engine's exchange segment; makes one CpuAssistStepRun per step that has CPU rows."""

    def __init__(self, segment_name: str, *, num_layers: int, module_shapes: dict[str, tuple[int, int]],
                 max_tokens: int, deadline_ms: int = DEFAULT_DEADLINE_MS, cuda: bool = False) -> None:
        """module_shapes: the model's ModelConfig.module_shapes() (one exchange slot per target module)."""
        self.layout = exchange_layout(segment_name, num_layers, module_shapes, max_tokens)
        self.segment = self.layout.create_segment()
        self.buffers = ExchangeBuffers(self.layout, self.segment)
        self.deadline_ms = deadline_ms
        self.timeouts = 0
        self.counters = None  # CudaSiteCounters on CUDA hosts: the sync-free path
        self._registered: torch.Tensor | None = None
        if cuda:
            self._enable_cuda()

    def _enable_cuda(self) -> None:
        from loraplex.gpu_engine.cpu_assist_cuda import CudaSiteCounters, cuda_stream_ops_available

        if not cuda_stream_ops_available():
            return  # host copies and waits still work, the launching thread just blocks per site
        whole = torch.frombuffer(self.segment.buf, dtype=torch.uint8)
        rc = torch.cuda.cudart().cudaHostRegister(whole.data_ptr(), self.segment.size, 0)
        if int(rc) != 0:
            return
        self._registered = whole
        self.counters = CudaSiteCounters(self.buffers)

    def step(self, cpu: CpuAssistStep, rows: list[tuple[int, int, int, int, HostAdapter]]) -> CpuAssistStepRun:
        """rows: (exchange row, first batch token, count, cpu_layers, adapter) per CPU-assisted row."""
        if cpu.exchange_rows > self.layout.max_tokens:
            raise ValueError(f"plan uses {cpu.exchange_rows} exchange rows; "
                             f"the exchange holds {self.layout.max_tokens}")
        cpu_rows = [CpuRow(first=first, count=n, xrow=xrow, cpu_layers=layers, adapter=adapter)
                    for xrow, first, n, layers, adapter in rows]
        if self.counters is not None:
            from loraplex.gpu_engine.cpu_assist_cuda import CudaCpuAssistStepRun

            return CudaCpuAssistStepRun(self.buffers, self.counters, cpu.seq, cpu.workers_per_layer, cpu_rows,
                                        self.deadline_ms)
        return CpuAssistStepRun(self.buffers, cpu.seq, cpu.workers_per_layer, cpu_rows, self.deadline_ms)

    def close(self) -> None:
        self.buffers.x.clear()
        self.buffers.out.clear()
        if self._registered is not None:
            torch.cuda.cudart().cudaHostUnregister(self._registered.data_ptr())
            self._registered = None
        self.segment.close()
        if self.segment.owner:
            self.segment.unlink()
