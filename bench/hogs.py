"""Noisy neighbours for benchmarks: processes that spin on the CPU while a block runs, each
anywhere the OS puts it or pinned to one core (`taskset`)."""
from __future__ import annotations

import subprocess
import sys
import time

SPIN = "while True: pass"


class Hogs:
    """`n` spinning processes while the block runs; `core`: the core each is pinned to (None: any)."""

    def __init__(self, n: int, core: str | None = None) -> None:
        self.n = n
        self.core = core
        self.procs: list[subprocess.Popen] = []

    def __enter__(self) -> Hogs:
        argv = [sys.executable, "-c", SPIN]
        if self.core is not None:
            argv = ["taskset", "-c", self.core, *argv]
        self.procs = [subprocess.Popen(argv) for _ in range(self.n)]
        if self.procs:
            time.sleep(0.5)  # let the scheduler place them before the measured work starts
        return self

    def __exit__(self, *exc) -> None:
        for proc in self.procs:
            proc.kill()
            proc.wait()
