"""Bound glibc's malloc arenas in the engine process.

glibc gives a thread that contends for the heap an arena of its own, up to
eight per core. The CPU adapter loader starts a thread per load (handing
copies to long-lived threads halved cpu_assist throughput on small hosts:
they lose the GIL to the step's compute), so over a long run the engine kept
touching new arenas and its RSS crept up. A couple of arenas is plenty for a
process whose big buffers are torch tensors. A no-op off glibc.
"""
from __future__ import annotations

import ctypes
import logging

M_ARENA_MAX = -8  # glibc malloc.h
ENGINE_ARENAS = 2

log = logging.getLogger(__name__)


def bound_malloc_arenas(limit: int = ENGINE_ARENAS) -> bool:
    """Cap the number of malloc arenas at `limit`; True when the C library took it."""
    try:
        # The process's own C library (as loraplex.lifetime does); no ldconfig lookup at start-up.
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # no C library to open, or not glibc (musl has no mallopt)
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    ok = mallopt(M_ARENA_MAX, limit) == 1
    if not ok:
        log.debug("mallopt(M_ARENA_MAX, %d) was refused", limit)
    return ok
