"""How every child process of the daemon ties its life to the daemon's (Linux).

One place for the prctl calls the engine, the cache manager, the CPU workers
and the warm spares all make: die with the parent (SIGKILL when it exits) and
show a short role name in ps/top. Stdlib only: a spare calls it before its
heavy imports.
"""
from __future__ import annotations

import ctypes
import signal

COMM_MAX = 15  # the kernel keeps 15 bytes of a process name
_PR_SET_PDEATHSIG = 1
_PR_SET_NAME = 15


def die_with_parent(name: str) -> None:
    """SIGKILL this process when its parent exits, and name it `name` (cut to COMM_MAX bytes).
    A no-op off Linux: there the parent still kills its children when it stops."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        libc.prctl(_PR_SET_NAME, name.encode()[:COMM_MAX], 0, 0, 0)
    except (OSError, AttributeError):
        pass
