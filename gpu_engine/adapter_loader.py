"""Bring an adapter from the host store into its pool pages as M layer groups
(Toppings §4.1), each group signalling when it has arrived.

On CUDA the copies run on a dedicated copy stream with one event per group, so
compute waits on exactly the group it needs, never on the host. On CPU a
background thread does the copies and sets one threading.Event per group; an
optional bandwidth throttle (test-only) makes loading span many layers so the
per-layer CPU/GPU switch is exercised without a GPU. The throttle models one
shared link, as the single CUDA copy stream is: each load books the link after
the loads started before it, so concurrent loads queue instead of each getting
the whole bandwidth.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import torch

from loraplex.contracts.layer_groups import layer_groups
from loraplex.gpu_engine.lora.peft_adapter import HostAdapter
from loraplex.gpu_engine.lora.torch_backend import ResidentLora, copy_adapter_layers, copy_head_parts
from loraplex.gpu_engine.pool import UnifiedPool


@dataclass(slots=True)
class GroupLoad:
    """One adapter in flight: group g holds `groups[g]` layers and is ready once `ready[g]` fires."""

    groups: list[range]
    ready: list  # threading.Event on CPU, torch.cuda.Event on CUDA
    group_of_layer: list[int] = field(default_factory=list)
    bytes_copied: int = 0
    error: BaseException | None = None

    def wait_layer(self, layer: int) -> float:
        """Block compute until the layer's group is in the pool; returns milliseconds waited (CPU)."""
        event = self.ready[self.group_of_layer[layer]]
        if isinstance(event, threading.Event):
            if event.is_set():
                return 0.0
            started = time.perf_counter()
            event.wait()
            if self.error is not None:
                raise RuntimeError(f"adapter load failed: {self.error}") from self.error
            return (time.perf_counter() - started) * 1e3
        torch.cuda.current_stream().wait_event(event)  # stream-ordered: the host never blocks
        return 0.0

    def loaded(self, layer: int) -> bool:
        event = self.ready[self.group_of_layer[layer]]
        return event.is_set() if isinstance(event, threading.Event) else bool(event.query())

    def done(self) -> bool:
        return all(self.loaded(g.start) for g in self.groups)


class AdapterLoader:
    def __init__(self, pool: UnifiedPool, *, throttle_bytes_per_s: float | None = None) -> None:
        self.pool = pool
        self.throttle = throttle_bytes_per_s
        self.cuda = pool.data.device.type == "cuda"
        self.copy_stream = torch.cuda.Stream(device=pool.data.device) if self.cuda else None
        self.total_bytes = 0
        self.started_bytes = 0  # bytes of every load started (the link carries them as the groups stream)
        self._link_free_at = 0.0  # throttled CPU loads: perf_counter time the emulated link is booked until

    def start(self, adapter: HostAdapter, resident: ResidentLora, groups: int) -> GroupLoad:
        num_layers = self.pool.data.shape[0]
        parts = layer_groups(num_layers, groups)
        load = GroupLoad(groups=parts, ready=[], group_of_layer=[0] * num_layers)
        for g, part in enumerate(parts):
            for layer in part:
                load.group_of_layer[layer] = g
        group_bytes = [sum((a.numel() + adapter.b[layer][m].numel()) * a.element_size()
                           for layer in part for m, a in adapter.a[layer].items()) for part in parts]
        self.started_bytes += sum(group_bytes)
        if self.cuda:
            self._start_cuda(adapter, resident, load)
        else:
            load.ready = [threading.Event() for _ in parts]
            if self.throttle is None and len(parts) == 1:
                self._copy_cpu(adapter, resident, load, None)  # nothing to overlap with: copy inline
            else:
                arrivals = self._book_link(group_bytes) if self.throttle else None
                threading.Thread(target=self._copy_cpu, args=(adapter, resident, load, arrivals), daemon=True,
                                 name=f"load-{adapter.name}").start()
        return load

    def _book_link(self, group_bytes: list[int]) -> list[float]:
        """Reserve the emulated link for one load's groups, after every load booked before it;
        returns the perf_counter time each group has fully arrived."""
        at = max(time.perf_counter(), self._link_free_at)
        arrivals = []
        for nbytes in group_bytes:
            at += nbytes / self.throttle
            arrivals.append(at)
        self._link_free_at = at
        return arrivals

    def _start_cuda(self, adapter: HostAdapter, resident: ResidentLora, load: GroupLoad) -> None:
        # The copy stream must not overtake the compute that last used these pages (evicted owner).
        self.copy_stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.copy_stream):
            for g, part in enumerate(load.groups):
                load.bytes_copied += self._copy_group(adapter, resident, g, part)
                event = torch.cuda.Event()
                event.record(self.copy_stream)
                load.ready.append(event)
        self.total_bytes += load.bytes_copied

    def _copy_group(self, adapter: HostAdapter, resident: ResidentLora, g: int, part: range) -> int:
        """Group g's layers; the first group also carries every layer's part of embed_tokens / lm_head
        (the embedding runs before layer 0, so it waits for group 0 only)."""
        copied = copy_head_parts(self.pool, adapter, resident) if g == 0 else 0
        return copied + copy_adapter_layers(self.pool, adapter, resident, part, heads=False)

    def _copy_cpu(self, adapter: HostAdapter, resident: ResidentLora, load: GroupLoad,
                  arrivals: list[float] | None) -> None:
        try:
            for g, part in enumerate(load.groups):
                load.bytes_copied += self._copy_group(adapter, resident, g, part)
                if arrivals is not None:
                    remaining = arrivals[g] - time.perf_counter()
                    if remaining > 0:
                        time.sleep(remaining)
                load.ready[g].set()
        except BaseException as exc:  # surface in wait_layer instead of hanging compute
            load.error = exc
            for event in load.ready:
                event.set()
        self.total_bytes += load.bytes_copied
