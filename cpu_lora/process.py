"""Process identity of CPU workers: role names, thread environment, Linux setup.

Owns what both sides agree on before a worker runs (its role name on the
command line and in ps/top, the one-thread environment) and the prctl calls
that make it die with its parent. Imports nothing heavy: the torch-free pool
uses it to build command lines.
"""
from __future__ import annotations

import ctypes
import signal

ROLE_PREFIX = "loraplex-cpu-worker"
_PR_SET_PDEATHSIG = 1
_PR_SET_NAME = 15
_COMM_MAX = 15  # the kernel keeps 15 bytes of a process name

# Every math library a worker might load gets one thread: the worker's
# parallelism is the number of processes, one per core (Toppings §4.2).
SINGLE_THREAD_ENV: dict[str, str] = {
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "NUMEXPR_NUM_THREADS": "1",
    "VECLIB_MAXIMUM_THREADS": "1",
    "BLIS_NUM_THREADS": "1",
}


def worker_role(index: int) -> str:
    """`loraplex-cpu-worker-N`: the name on the worker's command line and in its logs."""
    return f"{ROLE_PREFIX}-{index}"


def worker_comm(index: int) -> str:
    """The 15-byte process name (ps -o comm, top): `loraplex-cpu-N` while N < 100."""
    return f"loraplex-cpu-{index}"[:_COMM_MAX]


def linux_process_setup(comm: str) -> None:
    """Die with the parent (SIGKILL on its exit) and show as `comm` in ps/top."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        libc.prctl(_PR_SET_NAME, comm.encode()[:_COMM_MAX], 0, 0, 0)
    except (OSError, AttributeError):
        pass  # not Linux: the pool still kills its workers when it stops
