"""Build a scheduling policy by name (torch-free).

`make_scheduler("fcfs" | "mlq" | "dlora", ...)` is the one place that maps a
configured policy name onto its class; every policy takes the same arguments
plus its own optional settings object.
"""
from __future__ import annotations

import time
from typing import Callable

from loraplex.contracts.geometry import PageGeometry
from loraplex.daemon.memory.allocator import PageAllocator
from loraplex.daemon.scheduler.base import BaseScheduler, Clock
from loraplex.daemon.scheduler.config import SchedulerConfig
from loraplex.daemon.scheduler.dlora import DloraConfig, DloraScheduler
from loraplex.daemon.scheduler.fcfs import FcfsScheduler
from loraplex.daemon.scheduler.mlq import MlqConfig, MlqScheduler

POLICIES: tuple[str, ...] = ("fcfs", "mlq", "dlora")


def make_scheduler(name: str, config: SchedulerConfig, geometry: PageGeometry, allocator: PageAllocator,
                   adapter_pages: Callable[[str], int], eos_token_ids: tuple[int, ...] = (), *,
                   adapter_rank: Callable[[str], int] | None = None, clock: Clock = time.monotonic,
                   mlq: MlqConfig | None = None, dlora: DloraConfig | None = None) -> BaseScheduler:
    """The scheduler for policy `name`; `mlq`/`dlora` are that policy's settings (defaults if None).
    adapter_rank: LoRA rank by adapter name (MLQ's C·rank term; page counts stand in without it)."""
    common = dict(adapter_rank=adapter_rank, clock=clock)
    if name == "fcfs":
        return FcfsScheduler(config, geometry, allocator, adapter_pages, eos_token_ids, **common)
    if name == "mlq":
        return MlqScheduler(config, geometry, allocator, adapter_pages, eos_token_ids, mlq=mlq, **common)
    if name == "dlora":
        return DloraScheduler(config, geometry, allocator, adapter_pages, eos_token_ids, dlora=dlora, **common)
    raise ValueError(f"unknown scheduling policy {name!r}; choose one of {', '.join(POLICIES)}")
