"""How a model's layers split into load groups: the unit in which an adapter streams into
the pool (the engine's loader) and in which the daemon's CPU-assist planner counts the
layers that arrive late. Both must split alike, so the split is defined once, here."""
from __future__ import annotations


def layer_groups(num_layers: int, groups: int) -> list[range]:
    """`groups` consecutive ranges covering layers [0, num_layers); earlier groups take the remainder."""
    groups = max(1, min(groups, num_layers))
    size, extra = divmod(num_layers, groups)
    out, start = [], 0
    for g in range(groups):
        end = start + size + (1 if g < extra else 0)
        out.append(range(start, end))
        start = end
    return out
