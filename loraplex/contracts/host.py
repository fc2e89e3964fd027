"""The cores this process may run on: its affinity mask (which a cgroup, `taskset` or systemd's
CPUAffinity narrows), else every core the OS reports. One reading for the engine (its torch
threads), the CPU worker pool (its workers' cores) and the simulator (its parallel runs).
"""
from __future__ import annotations

import os


def allowed_cores() -> list[int]:
    """The core ids this process may run on, in order."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def usable_cores() -> int:
    """How many cores this process may run on (at least 1)."""
    return max(1, len(allowed_cores()))
