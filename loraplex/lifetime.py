"""How every child process of the daemon ties its life to the daemon's (Linux).

One place for the prctl calls the engine, the cache manager, the CPU workers
and the warm spares all make: die with the parent and show a short role name
in ps/top. A child that owns shared memory cannot let the kernel SIGKILL it
when the daemon dies (nothing would remove its segments until the next start):
it waits on the parent's pidfd in a thread instead, cleans up, then SIGKILLs
itself. Stdlib only: a spare calls it before its heavy imports.
"""
from __future__ import annotations

import ctypes
import os
import select
import signal
import threading
from collections.abc import Callable

COMM_MAX = 15  # the kernel keeps 15 bytes of a process name
_PR_SET_PDEATHSIG = 1
_PR_SET_NAME = 15


def die_with_parent(name: str, on_parent_death: Callable[[], object] | None = None) -> None:
    """Die when the parent exits, and name this process `name` (cut to COMM_MAX bytes).

    Without `on_parent_death` the kernel SIGKILLs us (PR_SET_PDEATHSIG). With it, a
    watcher thread waits on the parent's pidfd, runs `on_parent_death` (say, unlink the
    shared memory we own), then SIGKILLs this process; where pidfds are unavailable the
    kernel signal is used and the cleanup falls to `loraplex cleanup` or the next start.
    A no-op off Linux: there the parent still kills its children when it stops."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_NAME, name.encode()[:COMM_MAX], 0, 0, 0)
        if on_parent_death is not None and _watch_parent(on_parent_death):
            libc.prctl(_PR_SET_PDEATHSIG, 0, 0, 0, 0)  # a spare armed the kernel signal; the watcher replaces it
            return
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def _watch_parent(on_parent_death: Callable[[], object]) -> bool:
    """Start the watcher thread; False where the parent cannot be watched (no pidfd_open)."""
    parent = os.getppid()
    try:
        pidfd = os.pidfd_open(parent)
    except (AttributeError, OSError):
        return False
    if os.getppid() != parent:  # it died before we held its pidfd: clean up at once
        os.close(pidfd)
        _die(on_parent_death)

    def watch() -> None:
        select.select([pidfd], [], [])  # readable once the parent has exited, however it died
        _die(on_parent_death)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()
    return True


def _die(on_parent_death: Callable[[], object]) -> None:
    try:
        on_parent_death()
    finally:
        os.kill(os.getpid(), signal.SIGKILL)
