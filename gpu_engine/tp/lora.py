"""One rank's unmerged LoRA in two halves around a collective (S-LoRA §6.1):
shrink (x·A of this rank's A shard for the tokens of every adapter segment,
packed into one [lora tokens, width] buffer, so one collective carries all
adapters and no base-model row) and expand (that buffer, once complete, times
this rank's B shard into its slice of the output). A and B^T rows are read
from the rank's pool pages through the single-device torch backend's indices.
"""
from __future__ import annotations

import torch

from loraplex.gpu_engine.lora.torch_backend import LoraGroup, module_rows


def targeting(groups: list[LoraGroup], module: str) -> list[LoraGroup]:
    """The segments whose adapter targets `module` (the same on every rank: ranks share the step)."""
    return [g for g in groups if module in g.lora.index]


def _packed(groups: list[LoraGroup]):
    """(group, its rows in the packed buffer) in order: segment after segment."""
    offset = 0
    for g in groups:
        n = g.end - g.start
        yield g, slice(offset, offset + n)
        offset += n


def shrink(x: torch.Tensor, pool_layer: torch.Tensor, module: str, groups: list[LoraGroup]) -> torch.Tensor:
    """[sum of segment lengths, width]: each segment's x·A^T of this rank's A rows in its first columns,
    zeros elsewhere; width = the most A rows any segment has (every rank computes the same width)."""
    width = max(g.lora.index[module][0].shape[0] for g in groups)
    z = x.new_zeros(sum(g.end - g.start for g in groups), width)
    for g, rows in _packed(groups):
        a = module_rows(pool_layer, g.lora, module, 0)  # [A rows, in_width]
        z[rows, : a.shape[0]] = x[g.start:g.end] @ a.t()
    return z


def expand_gathered(out: torch.Tensor, gathered: torch.Tensor, pool_layer: torch.Tensor, module: str,
                    groups: list[LoraGroup], world_size: int) -> None:
    """Column-parallel: `gathered` [lora tokens, N·width] holds rank j's x·A shard at [j·width, ...); each
    segment's padded x·A [count, N·rows] times this rank's B^T [N·rows, out/N] is added into `out`."""
    width = gathered.shape[1] // world_size
    for g, rows in _packed(groups):
        r = g.lora.index[module][0].shape[0]
        xa = gathered[rows].view(-1, world_size, width)[:, :, :r].reshape(-1, world_size * r)
        out[g.start:g.end] += xa @ module_rows(pool_layer, g.lora, module, 1) * g.lora.scaling


def expand_reduced(out_slice: torch.Tensor, reduced: torch.Tensor, pool_layer: torch.Tensor, module: str,
                   groups: list[LoraGroup]) -> None:
    """Row-parallel: `reduced` [lora tokens, width] holds the summed x·A; each segment's [count, r] times
    this rank's B^T [r, out/N] is added into `out_slice`, this rank's columns of the partial output."""
    for g, rows in _packed(groups):
        bt = module_rows(pool_layer, g.lora, module, 1)
        out_slice[g.start:g.end] += reduced[rows, : bt.shape[0]] @ bt * g.lora.scaling
