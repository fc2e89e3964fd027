"""Unmerged multi-LoRA through the Triton kernels (same `apply` contract as
`TorchLoraBackend`): BGMV/MBGMV when every adapter segment of the step is a
single token, SGMV over the segments otherwise.

Per step (one `groups` list, reused by every layer and module) it builds the
metadata once: token/segment slot tables and one row-offset table over all
target modules, from host copies of each adapter's offsets cached per
ResidentLora. It never copies A/B out of the pool.

A decode-graph runner may `pin` a static step (capacity-sized tables it refills
in place before each replay): the launches then read only fixed buffers.
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
        self._pinned: _Step | None = None

    # ---- static steps (CUDA-graph replay) ---------------------------------------------------
    @staticmethod
    def static_step(tokens: int, num_slots: int, width: int, modules: Sequence[str], device: torch.device, *,
                    share: _Step | None = None) -> _Step:
        """Tables sized from capacity (slots, max rank, every module): MBGMV, whose grid and tiles
        depend on none of the batch's ranks, so one capture serves every adapter mix. `share`: a
        larger static step whose tables and slot buffer (its first `tokens` entries) this one reuses."""
        if share is not None:
            if tokens > share.token_slot.shape[0]:
                raise ValueError(f"a {tokens}-token step cannot share a {share.token_slot.shape[0]}-token one")
            return _Step(groups=[], key=("static", tokens), kernel="mbgmv", modules=share.modules,
                         tables=share.tables, token_slot=share.token_slot[:tokens], seg_start=share.seg_start,
                         seg_len=share.seg_len, seg_slot=share.seg_slot, max_seg_len=1)
        names = [m for m in MODULE_ORDER if m in modules] + sorted(set(modules) - set(MODULE_ORDER))
        shape = (len(names), num_slots, width)
        tables = LoraTables(torch.zeros(shape, dtype=torch.int64, device=device),
                            torch.zeros(shape, dtype=torch.int64, device=device),
                            torch.zeros(shape[:2], dtype=torch.int32, device=device),
                            torch.zeros(num_slots, dtype=torch.float32, device=device), width)
        none = torch.zeros(0, dtype=torch.int32, device=device)
        return _Step(groups=[], key=("static", tokens), kernel="mbgmv", modules={m: i for i, m in enumerate(names)},
                     tables=tables, token_slot=torch.full((tokens,), -1, dtype=torch.int32, device=device),
                     seg_start=none, seg_len=none, seg_slot=none, max_seg_len=1)

    def fill_static(self, step: _Step, groups: list[LoraGroup]) -> None:
        """Write this batch's adapters into a static step's buffers in place (host-built, one copy each).

        Slots and rank columns past this batch's are left stale: no token points at them and the
        ranks mask the columns."""
        tables, token_slot = step.tables, step.token_slot
        tokens = token_slot.shape[0]
        loras, group_slots = _number_adapters(groups, tokens, "the bucket's")
        host_slot = torch.full((tokens,), -1, dtype=torch.int32)
        for g, slot in zip(groups, group_slots):
            host_slot[g.start: g.end] = slot
        token_slot.copy_(host_slot)
        if not loras:
            return
        n, names = len(loras), list(step.modules)
        if n > tables.num_slots or max(lora.rank for lora in loras) > tables.width:
            raise ValueError(f"{n} adapters of rank <= {max(lora.rank for lora in loras)} exceed the static "
                             f"tables ({tables.num_slots} slots, width {tables.width})")
        width = max(lora.rank for lora in loras)
        a = torch.zeros(len(names), n, width, dtype=torch.int64)
        b = torch.zeros(len(names), n, width, dtype=torch.int64)
        ranks = torch.zeros(len(names), n, dtype=torch.int32)
        for s, lora in enumerate(loras):
            for module, (a_rows, b_rows) in self._host_offsets(lora).items():
                m = step.modules.get(module)
                if m is None:
                    raise ValueError(f"adapter {lora.name!r} targets {module!r}, which the static tables lack")
                ranks[m, s] = len(a_rows)
                a[m, s, : len(a_rows)] = torch.as_tensor(a_rows, dtype=torch.int64)
                b[m, s, : len(b_rows)] = torch.as_tensor(b_rows, dtype=torch.int64)
        tables.a_off[:, :n, :width].copy_(a)
        tables.b_off[:, :n, :width].copy_(b)
        tables.ranks[:, :n].copy_(ranks)
        tables.scaling[:n].copy_(torch.tensor([lora.scaling for lora in loras], dtype=torch.float32))

    def pin(self, step: _Step | None) -> None:
        """Serve every launch from `step` (None: back to per-step metadata)."""
        self._pinned = step

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
        if self._pinned is not None:
            if self._pinned.token_slot.shape[0] != x.shape[0]:
                raise ValueError(f"pinned step holds {self._pinned.token_slot.shape[0]} tokens, x has {x.shape[0]}")
            return self._pinned
        step = self._step
        tokens = x.shape[0]
        # ids are stable: the cached step holds its groups, hence its ResidentLoras
        key = (tokens, x.device, *((id(g.lora), g.start, g.end) for g in groups))
        if step is not None and step.key == key:
            return step
        self._step = self._build(groups, key, tokens, x.device)
        return self._step

    def _build(self, groups: list[LoraGroup], key: tuple[object, ...], tokens: int, device: torch.device) -> _Step:
        loras, group_slots = _number_adapters(groups, tokens, "the step's")
        token_slot = [-1] * tokens
        seg: list[list[int]] = [[], [], []]  # start, length, slot per segment
        for g, slot in zip(groups, group_slots):
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


def _number_adapters(groups: list[LoraGroup], tokens: int, where: str) -> tuple[list[ResidentLora], list[int]]:
    """The distinct adapters of `groups` in first-use order, and each group's slot among them;
    refuses a segment outside the `tokens` rows."""
    slots: dict[int, int] = {}
    loras: list[ResidentLora] = []
    group_slots: list[int] = []
    for g in groups:
        if not 0 <= g.start <= g.end <= tokens:
            raise ValueError(f"segment [{g.start}, {g.end}) outside {where} {tokens} tokens")
        slot = slots.setdefault(id(g.lora), len(loras))
        if slot == len(loras):
            loras.append(g.lora)
        group_slots.append(slot)
    return loras, group_slots
