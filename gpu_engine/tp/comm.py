"""The process group of one tensor-parallel engine and the collectives its ranks
run, each counted by what it carries (so bench/tp_comm.py measures bytes from a
real run, not from the formula it checks).

gloo on CPU, NCCL on CUDA; ranks rendezvous over TCP on loopback. Nothing is
pickled: only tensors cross (torch.distributed's object collectives are never used).
"""
from __future__ import annotations

import datetime
from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.distributed as dist


@dataclass(slots=True)
class CommLedger:
    """Elements and bytes of every collective's result, by tag ("base", "lora", "embed", "lm_head",
    "assist": CPU-assisted rows)."""

    elems: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    bytes: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    calls: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    def add(self, tag: str, t: torch.Tensor) -> None:
        self.elems[tag] += t.numel()
        self.bytes[tag] += t.numel() * t.element_size()
        self.calls[tag] += 1

    def clear(self) -> None:
        self.elems.clear()
        self.bytes.clear()
        self.calls.clear()


class TpComm:
    """One rank's view of the group: its index, the group size and the collectives."""

    def __init__(self, rank: int, world_size: int, group: dist.ProcessGroup | None = None) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside a group of {world_size}")
        self.rank = rank
        self.world_size = world_size
        self.group = group
        self.ledger = CommLedger()

    @classmethod
    def init(cls, rank: int, world_size: int, port: int, *, backend: str = "gloo",
             timeout_s: float = 60.0) -> TpComm:
        """Join the group at tcp://127.0.0.1:port (rank 0 hosts the store)."""
        if world_size > 1 and not dist.is_initialized():
            dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                    world_size=world_size, timeout=datetime.timedelta(seconds=timeout_s))
        return cls(rank, world_size, dist.group.WORLD if world_size > 1 else None)

    def close(self) -> None:
        if self.world_size > 1 and dist.is_initialized():
            dist.destroy_process_group()

    def all_reduce(self, t: torch.Tensor, tag: str) -> torch.Tensor:
        """Sum of `t` over the ranks, in place."""
        if self.world_size > 1:
            self.ledger.add(tag, t)
            dist.all_reduce(t, group=self.group)
        return t

    def all_gather_last(self, t: torch.Tensor, tag: str) -> torch.Tensor:
        """[..., k] on every rank -> [..., N·k], rank i's part at [i·k, (i+1)·k)."""
        if self.world_size == 1:
            return t
        parts = [torch.empty_like(t) for _ in range(self.world_size)]
        dist.all_gather(parts, t.contiguous(), group=self.group)
        out = torch.cat(parts, dim=-1)
        self.ledger.add(tag, out)
        return out

    def gather_last(self, t: torch.Tensor, tag: str) -> torch.Tensor | None:
        """Like all_gather_last, but only rank 0 receives (and returns) the result; others get None."""
        if self.world_size == 1:
            return t
        t = t.contiguous()
        parts = [torch.empty_like(t) for _ in range(self.world_size)] if self.rank == 0 else None
        dist.gather(t, parts, dst=0, group=self.group)
        if self.rank != 0:
            return None
        out = torch.cat(parts, dim=-1)
        self.ledger.add(tag, out)
        return out

    def scatter_last(self, t: torch.Tensor | None, out: torch.Tensor, tag: str) -> torch.Tensor:
        """Rank 0's `t` [..., N·k] cut into N column blocks; rank i receives block i into `out` [..., k]
        (`t` is read on rank 0 only, None elsewhere). Counted as what rank 0 sends: the whole of `t`."""
        if self.world_size == 1:
            return out.copy_(t)
        parts = None
        if self.rank == 0:
            if t is None or t.shape[-1] != out.shape[-1] * self.world_size:
                raise ValueError(f"rank 0 must scatter {self.world_size} column blocks of {out.shape[-1]}")
            parts = [p.contiguous() for p in t.chunk(self.world_size, dim=-1)]
            self.ledger.add(tag, t)
        dist.scatter(out, parts, src=0, group=self.group)
        return out

    def broadcast(self, t: torch.Tensor, tag: str) -> torch.Tensor:
        """Rank 0's `t` into every rank's `t` (same shape and dtype everywhere), in place."""
        if self.world_size > 1:
            self.ledger.add(tag, t)
            dist.broadcast(t, src=0, group=self.group)
        return t
