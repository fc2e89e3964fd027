"""The metadata every LoRA kernel reads: per (module, adapter slot) row-offset
tables into one layer of the unified pool, ranks and scalings, plus the torch
reference of shrink/expand that BGMV, MBGMV and SGMV must all equal.

Tables only point into the pool (S-LoRA §5.3): A and B^T rows are never
gathered into contiguous buffers. Owns no kernel and launches nothing.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from loraplex.kernels.runtime import FLOAT_DTYPES, INDEX_DTYPES, check_contiguous, check_tensor

MAX_FUSED_MODULES = 3  # q/k/v or gate/up: one launch writes up to three outputs


@dataclass(frozen=True, slots=True)
class LoraTables:
    """Adapters of one step, indexed [module, slot].

    Row j < ranks[m, s] of A (module m, slot s) is `flat[a_off[m, s, j] : + in_features]`,
    row j of B^T is `flat[b_off[m, s, j] : + out_features]`; entries at j >= rank are unused.
    rank 0 means the adapter does not target that module (its tokens cost nothing).
    """

    a_off: torch.Tensor  # [M, S, R] int64
    b_off: torch.Tensor  # [M, S, R] int64
    ranks: torch.Tensor  # [M, S] int32
    scaling: torch.Tensor  # [S] float32
    max_rank: int  # host copy of ranks.max(), sizes padded tiles without a device sync

    @property
    def num_modules(self) -> int:
        return int(self.a_off.shape[0])

    @property
    def num_slots(self) -> int:
        return int(self.a_off.shape[1])

    @property
    def width(self) -> int:
        return int(self.a_off.shape[2])

    def select(self, modules: Sequence[int]) -> LoraTables:
        """Tables of a subset of modules (a view when they are consecutive)."""
        idx = list(modules)
        if idx == list(range(idx[0], idx[0] + len(idx))):
            pick = slice(idx[0], idx[0] + len(idx))
            a, b, r = self.a_off[pick], self.b_off[pick], self.ranks[pick]
        else:
            sel = torch.tensor(idx, device=self.a_off.device)
            a, b, r = self.a_off[sel], self.b_off[sel], self.ranks[sel]
        return LoraTables(a, b, r, self.scaling, self.max_rank)

    def check(self, num_modules: int) -> None:
        m, s, w = self.a_off.shape if self.a_off.dim() == 3 else (None, None, None)
        check_tensor("tables.a_off", self.a_off, ndim=3, dtypes=(torch.int64,))
        check_tensor("tables.b_off", self.b_off, ndim=3, dtypes=(torch.int64,), shape=(m, s, w))
        check_tensor("tables.ranks", self.ranks, ndim=2, dtypes=(torch.int32,), shape=(m, s))
        check_tensor("tables.scaling", self.scaling, ndim=1, dtypes=(torch.float32,), shape=(s,))
        for name in ("a_off", "b_off", "ranks"):
            check_contiguous(f"tables.{name}", getattr(self, name))
        if m != num_modules:
            raise ValueError(f"tables cover {m} modules, the launch has {num_modules}")
        if not 0 <= self.max_rank <= w:
            raise ValueError(f"max_rank {self.max_rank} outside the table width {w}")


def build_tables(rows: Sequence[Sequence[tuple[Sequence[int], Sequence[int]] | None]], scaling: Sequence[float],
                 device: torch.device | str) -> LoraTables:
    """rows[m][s] = (a offsets, b offsets) of module m in slot s, or None when not targeted.

    Assembled on the host and moved with one copy per tensor.
    """
    num_modules, num_slots = len(rows), len(scaling)
    ranks = [[0 if cell is None else len(cell[0]) for cell in row] for row in rows]
    width = max([1] + [r for row in ranks for r in row])
    a = torch.zeros(num_modules, num_slots, width, dtype=torch.int64)
    b = torch.zeros(num_modules, num_slots, width, dtype=torch.int64)
    for m, row in enumerate(rows):
        if len(row) != num_slots:
            raise ValueError(f"module {m} has {len(row)} slots, expected {num_slots}")
        for s, cell in enumerate(row):
            if cell is not None:
                if len(cell[0]) != len(cell[1]):
                    raise ValueError(f"module {m} slot {s}: {len(cell[0])} A rows but {len(cell[1])} B rows")
                a[m, s, : len(cell[0])] = torch.as_tensor(cell[0], dtype=torch.int64)
                b[m, s, : len(cell[1])] = torch.as_tensor(cell[1], dtype=torch.int64)
    r = torch.tensor(ranks, dtype=torch.int32).reshape(num_modules, num_slots)
    max_rank = max((rank for row in ranks for rank in row), default=0)
    s = torch.tensor(list(scaling), dtype=torch.float32)
    return LoraTables(a.to(device), b.to(device), r.to(device), s.to(device), max_rank)


def check_lora_args(x: torch.Tensor | None, flat: torch.Tensor, tables: LoraTables, num_modules: int) -> None:
    """Shared checks for x [T, in] (when given) and the flat pool layer the tables point into."""
    if x is not None:
        check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    check_tensor("flat", flat, ndim=1, dtypes=FLOAT_DTYPES)
    if not 1 <= num_modules <= MAX_FUSED_MODULES:
        raise ValueError(f"between 1 and {MAX_FUSED_MODULES} modules per launch, got {num_modules}")
    tables.check(num_modules)


def check_outputs(outs: Sequence[torch.Tensor], tokens: int) -> None:
    if not 1 <= len(outs) <= MAX_FUSED_MODULES:
        raise ValueError(f"between 1 and {MAX_FUSED_MODULES} outputs per launch, got {len(outs)}")
    for i, out in enumerate(outs):
        check_tensor(f"outs[{i}]", out, ndim=2, dtypes=FLOAT_DTYPES, shape=(tokens, None))
        if out.dtype != outs[0].dtype:
            raise ValueError(f"outputs of one launch must share a dtype, got {outs[0].dtype} and {out.dtype}")


def check_index(name: str, t: torch.Tensor, size: int | None = None) -> None:
    check_tensor(name, t, ndim=1, dtypes=INDEX_DTYPES, shape=None if size is None else (size,))
    check_contiguous(name, t)


def output_args(outs: Sequence[torch.Tensor]) -> list[object]:
    """(pointer, columns, row stride) for three outputs; missing ones repeat the first with 0 columns."""
    padded = list(outs) + [outs[0]] * (MAX_FUSED_MODULES - len(outs))
    cols = [o.shape[1] for o in outs] + [0] * (MAX_FUSED_MODULES - len(outs))
    return [*padded, *cols, *[o.stride(0) for o in padded]]


# ---- torch reference ------------------------------------------------------------------------------
def reference_shrink(x: torch.Tensor, flat: torch.Tensor, token_slot: torch.Tensor, tables: LoraTables,
                     in_features: int) -> torch.Tensor:
    """y[m, t, j] = x[t] . A_{m, slot(t)}[j] for j < rank, else 0 (float32) -> [M, T, R]."""
    y = torch.zeros(tables.num_modules, x.shape[0], tables.width, dtype=torch.float32, device=x.device)
    cols = torch.arange(in_features, device=x.device)
    for t, slot in enumerate(token_slot.tolist()):
        if slot < 0:
            continue
        for m in range(tables.num_modules):
            r = int(tables.ranks[m, slot])
            a = flat[tables.a_off[m, slot, :r, None] + cols].float()  # [r, in]
            y[m, t, :r] = a @ x[t].float()
    return y


def reference_expand(outs: Sequence[torch.Tensor], y: torch.Tensor, flat: torch.Tensor, token_slot: torch.Tensor,
                     tables: LoraTables) -> None:
    """outs[m][t] += scaling[slot] * y[m, t, :r] @ B^T_{m, slot}, in place; tokens without a slot untouched."""
    for t, slot in enumerate(token_slot.tolist()):
        if slot < 0:
            continue
        for m, out in enumerate(outs):
            r = int(tables.ranks[m, slot])
            if r == 0:
                continue
            cols = torch.arange(out.shape[1], device=out.device)
            bt = flat[tables.b_off[m, slot, :r, None] + cols].float()  # [r, out]
            delta = (y[m, t, :r] @ bt) * float(tables.scaling[slot])
            out[t] = (out[t].float() + delta).to(out.dtype)
