"""Unmerged multi-LoRA through the Triton kernels (same `apply` contract as
`TorchLoraBackend`): BGMV/MBGMV when every adapter segment of the step is a
single token, SGMV over the segments otherwise.

Per step (one `groups` list, reused by every layer and module) it builds the
metadata once: token/segment slot tables and one row-offset table over all
target modules, from host copies of each adapter's offsets cached per
ResidentLora. It never copies A/B out of the pool.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from loraplex.gpu_engine.lora.torch_backend import LoraGroup, ResidentLora
from loraplex.kernels.lora_tables import MAX_FUSED_MODULES, LoraTables, build_tables
from loraplex.kernels.runtime import require_triton

MODULE_ORDER = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
KERNELS = ("auto", "bgmv", "mbgmv", "sgmv")
HostOffsets = dict[str, tuple[list[int], list[int]]]


@dataclass(slots=True)
class _Step:
    """Metadata of one step's adapter segments, shared by all layers and modules."""

    groups: list[LoraGroup]  # keeps its ResidentLoras alive, so the ids in `key` stay unique
    key: tuple[object, ...]
    kernel: str  # bgmv | mbgmv | sgmv
    modules: dict[str, int]  # module -> row of the full tables
    tables: LoraTables | None  # over all targeted modules; None when no module is targeted
    token_slot: torch.Tensor  # [T] int32, -1 = no adapter
    seg_start: torch.Tensor  # [S] int32
    seg_len: torch.Tensor  # [S] int32
    seg_slot: torch.Tensor  # [S] int32
    max_seg_len: int
    selected: dict[tuple[str, ...], LoraTables] = field(default_factory=dict)


class TritonLoraBackend:
    def __init__(self, *, kernel: str = "auto", gemv_max_segment: int = 1, cache_size: int = 1024) -> None:
        """kernel: auto | bgmv | mbgmv | sgmv. auto uses BGMV (equal ranks) or MBGMV (mixed ranks) when no
        segment is longer than gemv_max_segment tokens, SGMV otherwise."""
        if kernel not in KERNELS:
            raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
        require_triton()
        from loraplex.kernels import lora_bgmv, lora_mbgmv, lora_sgmv  # after the TRITON_INTERPRET check

        self._bgmv, self._mbgmv, self._sgmv = lora_bgmv, lora_mbgmv, lora_sgmv
        self.kernel = kernel
        self.gemv_max_segment = gemv_max_segment
        self._offsets: OrderedDict[int, tuple[ResidentLora, HostOffsets]] = OrderedDict()
        self._cache_size = cache_size
        self._step: _Step | None = None

    # ---- LoraBackend contract ---------------------------------------------------------------
    def apply(self, out: torch.Tensor, x: torch.Tensor, pool_layer: torch.Tensor, module: str,
              groups: list[LoraGroup]) -> None:
        # x: [tokens, in], out: [tokens, out] (base projection output, updated in place)
        self.apply_fused([out], x, pool_layer, [module], groups)

    def apply_fused(self, outs: Sequence[torch.Tensor], x: torch.Tensor, pool_layer: torch.Tensor,
                    modules: Sequence[str], groups: list[LoraGroup]) -> None:
        """Several projections of the same x (q/k/v, gate/up): one shrink and one expand launch per 3 modules."""
        if len(outs) != len(modules):
            raise ValueError(f"{len(outs)} outputs for {len(modules)} modules")
        if not groups:
            return
        step = self._step_for(groups, x)
        full = step.tables
        if full is None:
            return
        x = x if x.stride(-1) == 1 else x.contiguous()
        live = [(o, m) for o, m in zip(outs, modules) if m in step.modules]
        for i in range(0, len(live), MAX_FUSED_MODULES):
            chunk = live[i: i + MAX_FUSED_MODULES]
            tables = self._select(step, full, tuple(m for _, m in chunk))
            self._run(step, [o for o, _ in chunk], x, pool_layer, tables)

    # ---- launches ---------------------------------------------------------------------------
    def _run(self, step: _Step, outs: list[torch.Tensor], x: torch.Tensor, flat: torch.Tensor,
             tables: LoraTables) -> None:
        if step.kernel == "sgmv":
            segs = (step.seg_start, step.seg_len, step.seg_slot)
            y = self._sgmv.sgmv_shrink(x, flat, *segs, tables, step.max_seg_len)
            self._sgmv.sgmv_expand(outs, y, flat, *segs, tables, step.max_seg_len)
        elif step.kernel == "bgmv":
            y = self._bgmv.bgmv_shrink(x, flat, step.token_slot, tables)
            self._bgmv.bgmv_expand(outs, y, flat, step.token_slot, tables)
        else:
            y = self._mbgmv.mbgmv_shrink(x, flat, step.token_slot, tables)
            self._mbgmv.mbgmv_expand(outs, y, flat, step.token_slot, tables)

    @staticmethod
    def _select(step: _Step, full: LoraTables, modules: tuple[str, ...]) -> LoraTables:
        tables = step.selected.get(modules)
        if tables is None:
            tables = full.select([step.modules[m] for m in modules])
            step.selected[modules] = tables
        return tables

    # ---- per-step metadata --------------------------------------------------------------------
    def _step_for(self, groups: list[LoraGroup], x: torch.Tensor) -> _Step:
        step = self._step
        tokens = x.shape[0]
        # ids are stable: the cached step holds its groups, hence its ResidentLoras
        key = (tokens, x.device, *((id(g.lora), g.start, g.end) for g in groups))
        if step is not None and step.key == key:
            return step
        self._step = self._build(groups, key, tokens, x.device)
        return self._step

    def _build(self, groups: list[LoraGroup], key: tuple[object, ...], tokens: int, device: torch.device) -> _Step:
        slots: dict[int, int] = {}
        loras: list[ResidentLora] = []
        token_slot = [-1] * tokens
        seg: list[list[int]] = [[], [], []]  # start, length, slot per segment
        for g in groups:
            if not 0 <= g.start <= g.end <= tokens:
                raise ValueError(f"segment [{g.start}, {g.end}) outside the step's {tokens} tokens")
            slot = slots.setdefault(id(g.lora), len(loras))
            if slot == len(loras):
                loras.append(g.lora)
            token_slot[g.start: g.end] = [slot] * (g.end - g.start)
            for column, value in zip(seg, (g.start, g.end - g.start, slot)):
                column.append(value)
        offsets = [self._host_offsets(lora) for lora in loras]
        present = {m for off in offsets for m in off}
        names = [m for m in MODULE_ORDER if m in present] + sorted(present - set(MODULE_ORDER))
        tables = None
        if names:
            rows = [[off.get(m) for off in offsets] for m in names]
            tables = build_tables(rows, [lora.scaling for lora in loras], device)
        max_seg = max((g.end - g.start for g in groups), default=0)
        kernel = self.kernel
        if kernel == "auto":
            if max_seg > self.gemv_max_segment:
                kernel = "sgmv"
            else:
                kernel = "bgmv" if len({lora.rank for lora in loras}) <= 1 else "mbgmv"
        meta = torch.tensor(token_slot + seg[0] + seg[1] + seg[2], dtype=torch.int32).to(device)  # one copy
        n = len(groups)
        return _Step(groups=groups, key=key, kernel=kernel, modules={m: i for i, m in enumerate(names)},
                     tables=tables, token_slot=meta[:tokens], seg_start=meta[tokens: tokens + n],
                     seg_len=meta[tokens + n: tokens + 2 * n], seg_slot=meta[tokens + 2 * n:], max_seg_len=max_seg)

    def _host_offsets(self, lora: ResidentLora) -> HostOffsets:
        """Host lists of the adapter's row offsets (one device read per placed adapter, then cached)."""
        hit = self._offsets.get(id(lora))
        if hit is not None and hit[0] is lora:
            self._offsets.move_to_end(id(lora))
            return hit[1]
        host = {m: (a.tolist(), b.tolist()) for m, (a, b) in lora.row_offsets.items()}
        self._offsets[id(lora)] = (lora, host)
        while len(self._offsets) > self._cache_size:
            self._offsets.popitem(last=False)
        return host
