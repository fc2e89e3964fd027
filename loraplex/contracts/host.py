"""What the host lends this process, read one way for everyone:
- the cores it may run on: its affinity mask (which a cgroup, `taskset` or systemd's
  CPUAffinity narrows), else every core the OS reports; for the engine (its torch threads), the
  CPU worker pool (its workers' cores) and the simulator (its parallel runs);
- a TCP port free on loopback, for a rendezvous (tensor parallelism), a test's or a benchmark's
  server: free when asked, bound by its user a moment later.
"""
from __future__ import annotations

import os
import socket


def allowed_cores() -> list[int]:
    """The core ids this process may run on, in order."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def usable_cores() -> int:
    """How many cores this process may run on (at least 1)."""
    return max(1, len(allowed_cores()))


def free_loopback_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
