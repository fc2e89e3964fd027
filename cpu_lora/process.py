"""Process identity of CPU workers: role names, thread environment, Linux setup.

Owns what both sides agree on before a worker runs: its role name on the
command line and in ps/top, and the one-thread environment (dying with the
parent is loraplex.lifetime's). Imports nothing heavy: the torch-free pool
uses it to build command lines.
"""
from __future__ import annotations

from loraplex.lifetime import COMM_MAX

ROLE_PREFIX = "loraplex-cpu-worker"

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
    return f"loraplex-cpu-{index}"[:COMM_MAX]

