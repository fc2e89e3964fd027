"""CPU-assisted prefill on CUDA, sync-free (Toppings §4.2).

Per site, everything is enqueued on the compute stream and the launching
thread never blocks: an async device-to-host copy of the CPU rows into the
pinned exchange, a stream-ordered store-and-wake of `ready` (driver host
function), a stream wait on `done` in host memory (cuStreamWaitValue64), then
host-to-device copies of the deltas and the adds.

Faults: a watchdog thread follows the step. If a site's workers miss the
deadline it aborts them (control word), computes that site's deltas on the
host from the exchange and the store, and releases the stream by storing the
expected `done` — results stay exact and the GPU never waits forever. Expected
`done` values are counted on the host, so no enqueue ever reads a word the GPU
has not reached yet; after a fallback the counters are re-read once the device
is idle.
"""
from __future__ import annotations

import threading

import torch

from loraplex import _C
from loraplex.gpu_engine.cpu_assist import DEFAULT_DEADLINE_MS, CpuRow, ExchangeBuffers


def cuda_stream_ops_available() -> bool:
    return torch.cuda.is_available() and _C.cuda_stream_ops_unavailable() == ""


class CudaSiteCounters:
    """Host-side expected values of every `done` word, advanced as sites are enqueued."""

    def __init__(self, buffers: ExchangeBuffers) -> None:
        self.buf = buffers
        self.done: list[int] = []
        self.device_done: list[int] = []
        self.resync()
        self.needs_resync = False

    def resync(self) -> None:
        layout = self.buf.layout
        self.done = [_C.atomic_load(self.buf.words, layout.done_word(s)) for s in range(layout.num_sites)]
        self.device_done = [_C.cuda_word_device_pointer(self.buf.words, layout.done_word(s))
                            for s in range(layout.num_sites)]


class CudaCpuAssistStepRun:
    def __init__(self, buffers: ExchangeBuffers, counters: CudaSiteCounters, seq: int, workers_per_layer: list[int],
                 rows: list[CpuRow], deadline_ms: int = DEFAULT_DEADLINE_MS) -> None:
        if counters.needs_resync:
            torch.cuda.synchronize()  # a fallback left late worker adds behind: read the words afresh
            counters.resync()
            counters.needs_resync = False
        self.buf = buffers
        self.counters = counters
        self.seq = seq
        self.workers = workers_per_layer
        self.rows = rows
        self.deadline_ms = deadline_ms
        self.timeouts = 0
        self.d2h_bytes = 0
        self.h2d_bytes = 0
        self.stream = torch.cuda.current_stream()
        self._sites: list[tuple[int, int, int, list[CpuRow]]] = []  # (site, stage, target, rows) for the watchdog

    def active(self, layer: int) -> list[CpuRow]:
        return [r for r in self.rows if r.cpu_layers > layer]

    def post(self, layer: int, stage: int, x: torch.Tensor) -> None:
        rows = self.active(layer)
        if not rows:
            return
        site = layer * 4 + stage
        xbuf = self.buf.x[stage]
        for r in rows:
            xbuf[r.xrow:r.xrow + r.count].copy_(x[r.first:r.first + r.count], non_blocking=True)
            self.d2h_bytes += r.count * x.shape[1] * 4
        _C.cuda_launch_store_and_wake(self.stream.cuda_stream, self.buf.words, self.buf.layout.ready_word(site),
                                      self.seq)
        self.counters.done[site] += self.workers[layer]
        self._sites.append((site, stage, self.counters.done[site], rows))

    def collect(self, layer: int, stage: int, x: torch.Tensor, outs: dict[str, torch.Tensor]) -> None:
        rows = self.active(layer)
        if not rows:
            return
        site = layer * 4 + stage
        _C.cuda_stream_wait_at_least(self.stream.cuda_stream, self.counters.device_done[site],
                                     self.counters.done[site])
        for module, out in outs.items():
            delta = self.buf.out[module]
            for r in rows:
                if r.targets(module):
                    rows_gpu = delta[r.xrow:r.xrow + r.count].to(out.device, non_blocking=True)
                    out[r.first:r.first + r.count] += rows_gpu.to(out.dtype)
                    self.h2d_bytes += r.count * out.shape[1] * 4

    def start_watchdog(self) -> threading.Thread:
        """Follow the enqueued sites from a host thread (after the forward was enqueued)."""
        thread = threading.Thread(target=self._watch, name="cpu-assist-watchdog", daemon=True)
        thread.start()
        return thread

    def _watch(self) -> None:
        layout, words = self.buf.layout, self.buf.words
        fallback = False
        for site, stage, target, rows in self._sites:
            # The stream reaches the post in its own time; only the workers' part has a deadline.
            _C.wait_until_at_least(words, layout.ready_word(site), self.seq, -1.0)
            if not fallback and _C.wait_until_at_least(words, layout.done_word(site), target, self.deadline_ms):
                continue
            if not fallback:
                fallback = True
                self.timeouts += 1
                self.counters.needs_resync = True
                _C.add_and_wake(words, layout.control_word, 1)  # abandon the workers' job
            self._compute_site(site // 4, stage, rows)
            _C.store_and_wake(words, layout.done_word(site), target)  # release the stream's wait

    def _compute_site(self, layer: int, stage: int, rows: list[CpuRow]) -> None:
        x = self.buf.x[stage]
        for module in self.buf.layout.stage_modules(stage):
            out = self.buf.out[module]
            for r in rows:
                if r.targets(module):
                    a = r.adapter.a[layer][module].to(torch.float32)
                    b = r.adapter.b[layer][module].to(torch.float32)
                    xs = x[r.xrow:r.xrow + r.count]
                    out[r.xrow:r.xrow + r.count] = (xs @ a.t()) @ b.t() * r.adapter.spec.scaling
