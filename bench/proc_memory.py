"""The memory a served system holds: its processes and all their descendants, summed and sampled
while it serves, the peak kept.

Each process counts its proportional set size (PSS, /proc/PID/smaps_rollup: a page shared by n
processes counts 1/n to each), so forked workers, shared memory and the libraries every process
maps count once for the tree, as they cost the host once. Where smaps_rollup cannot be read
(another user's process, an old kernel) the process's RSS stands in. Linux only; elsewhere the
peak is None.
"""
from __future__ import annotations

import os
import threading
from pathlib import Path

PROC = Path("/proc")


def children_of() -> dict[int, list[int]]:
    """Every process's children, from /proc/PID/stat (the parent is the field after the state)."""
    out: dict[int, list[int]] = {}
    for entry in PROC.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue  # it ended while we looked
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses, so split after the last ")"
        ppid = int(stat.rpartition(")")[2].split()[1])
        out.setdefault(ppid, []).append(int(entry.name))
    return out


def tree(roots: list[int]) -> list[int]:
    """The roots and every descendant alive now."""
    children, seen, todo = children_of(), [], list(roots)
    while todo:
        pid = todo.pop()
        if pid not in seen:
            seen.append(pid)
            todo.extend(children.get(pid, ()))
    return seen


def _field_kb(path: Path, name: str) -> int | None:
    try:
        for line in path.read_text().splitlines():
            if line.startswith(name):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def process_kb(pid: int) -> int:
    """PSS of one process in KiB (its RSS where PSS cannot be read; 0 once it has ended)."""
    pss = _field_kb(PROC / str(pid) / "smaps_rollup", "Pss:")
    if pss is not None:
        return pss
    return _field_kb(PROC / str(pid) / "status", "VmRSS:") or 0


def tree_mb(roots: list[int]) -> float:
    return sum(process_kb(pid) for pid in tree(roots)) / 1024


class PeakMemory:
    """Samples the trees under `roots` every `interval_s` while the block runs; `peak_mb` is the
    largest sum seen (None where /proc is absent)."""

    def __init__(self, roots: list[int], interval_s: float = 0.5) -> None:
        self.roots = list(roots)
        self.interval_s = interval_s
        self.peak_mb: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="peak-memory", daemon=True)

    def sample(self) -> None:
        if not PROC.is_dir() or os.name != "posix":
            return
        now = tree_mb(self.roots)
        self.peak_mb = now if self.peak_mb is None else max(self.peak_mb, now)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def __enter__(self) -> PeakMemory:
        self.sample()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()
