"""The control plane of a tensor-parallel engine: rank 0 hands every order it runs
to the other ranks, and the ranks agree on whether it succeeded everywhere.

Orders travel as their msgpack bytes (ipc/codec.py), a length then a uint8 tensor,
over a gloo group of their own: never pickled (no object collectives), never on
the GPU, and with no practical timeout, since a rank waiting for the next order is
idle, not stuck (a dead rank is noticed by its pidfd, gpu_engine/tp/group.py). The
model's collectives keep their own group and its short timeout.
"""
from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from loraplex.ipc.codec import DEFAULT_LIMITS, DecodeLimits, decode, encode
from loraplex.ipc.protocol import Message

IDLE_TIMEOUT = datetime.timedelta(days=365)  # waiting for the next order is idleness, not a fault


class ControlChannel:
    def __init__(self, rank: int, world_size: int, group: dist.ProcessGroup | None,
                 limits: DecodeLimits = DEFAULT_LIMITS) -> None:
        """limits: the daemon socket's (the orders rank 0 shares came in within them)."""
        self.rank = rank
        self.world_size = world_size
        self.limits = limits
        self.group = group

    @classmethod
    def create(cls, rank: int, world_size: int) -> ControlChannel:
        """Every rank calls this at the same point after joining the default group."""
        return cls(rank, world_size, dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT))

    def share(self, msg: Message) -> None:
        """Rank 0: send `msg` to every other rank (they take it with `receive`)."""
        data = encode(msg, self.limits)
        self._broadcast(torch.tensor([len(data)], dtype=torch.int64))
        self._broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8))

    def receive(self) -> Message:
        """Another rank: the next order rank 0 shared, decoded within the same bounds it was
        encoded under (ProtocolError when it is not a valid message)."""
        size = self._broadcast(torch.zeros(1, dtype=torch.int64))
        n = int(size.item())
        if not 0 < n <= self.limits.max_message_bytes:
            raise ValueError(f"rank 0 announced an order of {n} bytes (limit {self.limits.max_message_bytes})")
        data = self._broadcast(torch.empty(n, dtype=torch.uint8))
        return decode(data.numpy().tobytes(), self.limits)

    def failures(self, failed: bool) -> int:
        """On how many ranks the order just run failed (every rank learns the same count)."""
        count = torch.tensor([int(failed)], dtype=torch.int64)
        dist.all_reduce(count, group=self.group)
        return int(count.item())

    def min_int(self, value: int) -> int:
        """The smallest of every rank's `value` (say, the pages every rank's memory can hold)."""
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t.item())

    def _broadcast(self, t: torch.Tensor) -> torch.Tensor:
        dist.broadcast(t, src=0, group=self.group)
        return t
