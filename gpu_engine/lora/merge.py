"""Merged-mode LoRA (dLoRA §4): fold one adapter into the base projection
weights, W ← W + s·B@A, so its requests run with no LoRA cost, and restore the
base weights bit-exactly afterwards.

The delta is computed in float32 and the sum cast back to the weight dtype.
LoRA on the embedding and the LM head merges too (their rows reassembled from
every layer's part); a tied LM head is untied for the merge (a copy of the
embedding while merged, so decode graphs, which captured the tied one, step
aside) and tied again at unmerge.
Unmerging never subtracts: the original tensors are copied aside before they
are overwritten (to pinned host memory for GPU weights, so merged mode costs no
extra GPU memory) and copied back. The executor calls
`MergeController.prepare(plan)` before each step; it is the only writer of the
base weights after load.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from loraplex.contracts.head_modules import EMBED, HEAD_MODULES, LM_HEAD
from loraplex.gpu_engine.lora.peft_adapter import HostAdapter
from loraplex.gpu_engine.model.weights import ModelWeights
from loraplex.ipc.engine_plan import RowPlan, StepPlan


@dataclass(slots=True)
class MergeState:
    """An adapter merged into `weights`; `saved` holds the overwritten originals."""

    adapter: str
    weights: ModelWeights
    saved: list[tuple[int, str, torch.Tensor]] = field(default_factory=list)  # (layer, module, original)
    untied: bool = False  # the tied LM head is a merged copy of the embedding until unmerge

    @property
    def active(self) -> bool:
        return bool(self.saved) or self.untied


def _backup(w: torch.Tensor, device: torch.device | str | None) -> torch.Tensor:
    target = torch.device("cpu") if device is None and w.device.type == "cuda" else torch.device(device or w.device)
    if target.type == "cpu" and w.device.type == "cuda":
        copy = torch.empty(w.shape, dtype=w.dtype, device="cpu", pin_memory=True)
        copy.copy_(w, non_blocking=True)  # ordered before the in-place merge on the same stream
        return copy
    return w.detach().to(target, copy=True)


@torch.no_grad()
def merge_adapter(weights: ModelWeights, adapter: HostAdapter, *,
                  backup_device: torch.device | str | None = None) -> MergeState:
    """Add s·B@A of every (layer, target module) of `adapter` into `weights` in place.
    backup_device: where the originals are kept (default: pinned host memory for CUDA
    weights, the weights' own device otherwise)."""
    if len(adapter.a) != len(weights.layers):
        raise ValueError(f"adapter {adapter.name!r} has {len(adapter.a)} layers, the model {len(weights.layers)}")
    state = MergeState(adapter=adapter.name, weights=weights)
    scaling = adapter.spec.scaling
    try:
        heads = [m for m in adapter.spec.targets if m in HEAD_MODULES]
        if heads:
            _merge_heads(state, adapter, heads, backup_device)
        for layer_idx, layer in enumerate(weights.layers):
            for module in adapter.spec.targets:
                if module in HEAD_MODULES:
                    continue
                w = layer.proj[module]  # [out, in]
                a = adapter.a[layer_idx][module].to(device=w.device, dtype=torch.float32)  # [r, in]
                b = adapter.b[layer_idx][module].to(device=w.device, dtype=torch.float32)  # [out, r]
                state.saved.append((layer_idx, module, _backup(w, backup_device)))
                w.copy_(torch.addmm(w.float(), b, a, alpha=scaling))  # float32 sum, cast back by copy_
    except BaseException:
        unmerge(state)
        raise
    return state


HEAD_CHUNK_ROWS = 8192  # vocabulary rows merged at a time: the float32 delta stays small


def _head_weight(weights: ModelWeights, module: str) -> torch.Tensor:
    return weights.embed if module == EMBED else weights.lm_head  # both [vocab, hidden]


def _merge_heads(state: MergeState, adapter: HostAdapter, heads: list[str],
                 backup_device: torch.device | str | None) -> None:
    """embed_tokens: E += s·(B A)^T (A [r, vocab], B [hidden, r]); lm_head: W += s·B A (A [r, hidden],
    B [vocab, r]); rows reassembled from every layer's part, merged HEAD_CHUNK_ROWS vocabulary rows
    at a time."""
    weights = state.weights
    if weights.lm_head is weights.embed:
        weights.lm_head = weights.embed.clone()  # merged apart from the embedding; unmerge ties it back
        state.untied = True
    vocab, hidden = weights.embed.shape
    for module in heads:
        w = _head_weight(weights, module)
        a, b = adapter.whole_head(module)  # [r, L * in_part], [L * out_part, r]
        if module == EMBED:
            a, b = b[:hidden].t(), a[:, :vocab].t()  # as lm_head's: vocabulary rows of B, [r, hidden] A
        else:
            a, b = a[:, :hidden], b[:vocab]
        a = a.to(device=w.device, dtype=torch.float32)
        if not (module == LM_HEAD and state.untied):  # the untied copy is dropped, not restored
            state.saved.append((-1, module, _backup(w, backup_device)))
        for start in range(0, vocab, HEAD_CHUNK_ROWS):
            rows = slice(start, min(start + HEAD_CHUNK_ROWS, vocab))
            chunk = b[rows].to(device=w.device, dtype=torch.float32)
            w[rows] = torch.addmm(w[rows].float(), chunk, a, alpha=adapter.spec.scaling)


@torch.no_grad()
def unmerge(state: MergeState) -> None:
    """Put back the original base weights, bit for bit."""
    for layer_idx, module, original in reversed(state.saved):
        w = _head_weight(state.weights, module) if layer_idx < 0 else state.weights.layers[layer_idx].proj[module]
        w.copy_(original, non_blocking=original.device.type == "cpu" and original.is_pinned())
    if state.untied:
        state.weights.lm_head = state.weights.embed
        state.untied = False
    if state.saved and state.saved[0][2].device.type == "cpu" and state.weights.embed.device.type == "cuda":
        torch.cuda.current_stream(state.weights.embed.device).synchronize()  # before the pinned copies are freed
    state.saved.clear()


class MergeController:
    """Keeps the base weights in the merge state each plan asks for.

    host_adapter: the executor's host copy of an adapter by name (A and B in host memory).
    """

    def __init__(self, weights: ModelWeights, host_adapter: Callable[[str], HostAdapter], *,
                 backup_device: torch.device | str | None = None) -> None:
        self.weights = weights
        self._host_adapter = host_adapter
        self._backup_device = backup_device
        self._state: MergeState | None = None
        self.switch_ms = 0.0  # time spent merging and unmerging, all calls

    @property
    def merged(self) -> str | None:
        return None if self._state is None else self._state.adapter

    @property
    def untied(self) -> bool:
        """The LM head is a merged copy of the tied embedding: captured decode graphs read the tied one."""
        return self._state is not None and self._state.untied

    def ensure(self, name: str | None) -> float:
        """Merge `name` (None: none); returns the milliseconds the switch took."""
        if name == self.merged:
            return 0.0
        started = time.perf_counter()
        if self._state is not None:
            state, self._state = self._state, None
            unmerge(state)
        if name is not None:
            self._state = merge_adapter(self.weights, self._host_adapter(name), backup_device=self._backup_device)
        ms = (time.perf_counter() - started) * 1e3
        self.switch_ms += ms
        return ms

    def forget(self, name: str) -> None:
        """`name` is about to leave the host store: unmerge it first if it is merged."""
        if self.merged == name:
            self.ensure(None)

    def prepare(self, plan: StepPlan) -> list[RowPlan]:
        """Bring the weights to `plan.merged_adapter` and return the rows as the LoRA path must see
        them: rows of the merged adapter run as base rows (their LoRA is in the weights)."""
        merged = plan.merged_adapter
        if merged is not None:
            stray = [r.request_id for r in plan.rows if r.adapter != merged]
            if stray:
                raise ValueError(f"a plan merged on {merged!r} holds rows of other adapters: {stray[:4]}")
        self.ensure(merged)
        if merged is None:
            return list(plan.rows)
        return [dataclasses.replace(r, adapter=None, cpu_layers=0) for r in plan.rows]
