"""Independent simulator runs, one after another or side by side in forked workers (torch-free).

Owns fanning runs out over CPU cores: a worker is a forked child that simulates one run
and writes its progress and its summary row back as JSON lines over a pipe (never
pickled); the row is the one summarize() makes in this process, so the output does not
depend on the number of workers. A run whose full SimResult is wanted (plots, a decision
log) runs in this process. Every child is reaped, also when the parent is interrupted.
"""
from __future__ import annotations

import json
import os
import selectors
import signal
from dataclasses import dataclass

from loraplex.contracts.host import usable_cores
from loraplex.daemon.sim.metrics import summarize
from loraplex.daemon.sim.profile import SimProfile
from loraplex.daemon.sim.progress import Progress
from loraplex.daemon.sim.simulator import SimConfig, SimResult, simulate
from loraplex.daemon.sim.workload import RequestEvent

_READ_BYTES = 1 << 16
_MAX_LINE = 1 << 24  # a summary row is a few kB; anything this long is not one


@dataclass(frozen=True, slots=True)
class SimRun:
    label: str  # what the progress line calls it
    events: list[RequestEvent]
    config: SimConfig
    profile: SimProfile


@dataclass(frozen=True, slots=True)
class RunOutcome:
    summary: dict[str, object]  # summarize() of the run
    result: SimResult | None  # the run itself, kept only for runs made in this process


def default_workers() -> int:
    """The CPU cores this process may use."""
    return usable_cores()


def run_all(runs: list[SimRun], *, workers: int = 1, progress: Progress | None = None, first: int = 0,
            keep_results: bool = False) -> list[RunOutcome]:
    """Every run's outcome, in the order of `runs`. workers > 1 forks up to that many children
    at once (where fork exists and the results are not kept); `first`: the index of runs[0]
    in `progress`."""
    if workers < 1:
        raise ValueError(f"workers must be at least 1, got {workers}")
    if keep_results or workers == 1 or len(runs) < 2 or not hasattr(os, "fork"):
        return [_in_process(first + i, run, progress, keep_results) for i, run in enumerate(runs)]
    return _Forked(runs, workers, progress, first).run()


def _in_process(index: int, run: SimRun, progress: Progress | None, keep: bool) -> RunOutcome:
    if progress is not None:
        progress.start(index, run.label)
    result = simulate(run.events, run.config, run.profile,
                      progress=None if progress is None else lambda share: progress.update(index, share))
    if progress is not None:
        progress.done(index)
    return RunOutcome(summarize(result), result if keep else None)


@dataclass(slots=True)
class _Child:
    index: int
    pid: int
    fd: int
    buffer: bytes = b""
    summary: dict[str, object] | None = None
    error: str | None = None


class _Forked:
    def __init__(self, runs: list[SimRun], workers: int, progress: Progress | None, first: int) -> None:
        self.runs = runs
        self.workers = workers
        self.progress = progress
        self.first = first
        self.outcomes: list[RunOutcome | None] = [None] * len(runs)
        self.children: dict[int, _Child] = {}  # by pipe fd
        self.selector = selectors.DefaultSelector()

    def run(self) -> list[RunOutcome]:
        todo = list(range(len(self.runs)))
        try:
            while todo or self.children:
                while todo and len(self.children) < self.workers:
                    self._spawn(todo.pop(0))
                for key, _ in self.selector.select():
                    self._read(self.children[key.fd])
        finally:
            self._reap_all()
            self.selector.close()
        return [outcome for outcome in self.outcomes if outcome is not None]

    def _spawn(self, index: int) -> None:
        run = self.runs[index]
        read_fd, write_fd = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: simulate, report, and leave without running the parent's cleanup
            status = 1
            try:
                os.close(read_fd)
                signal.signal(signal.SIGINT, signal.SIG_DFL)  # Ctrl-C stops it with the parent
                result = simulate(run.events, run.config, run.profile,
                                  progress=lambda share: _send(write_fd, {"share": share}))
                _send(write_fd, {"summary": summarize(result)})
                status = 0
            except BaseException as exc:  # reported to the parent, which raises it
                try:
                    _send(write_fd, {"error": f"{type(exc).__name__}: {exc}"})
                except OSError:
                    pass
            finally:
                os._exit(status)
        os.close(write_fd)
        self.children[read_fd] = _Child(index, pid, read_fd)
        self.selector.register(read_fd, selectors.EVENT_READ)
        if self.progress is not None:
            self.progress.start(self.first + index, run.label)

    def _read(self, child: _Child) -> None:
        chunk = os.read(child.fd, _READ_BYTES)
        if not chunk:
            self._close(child)
            return
        child.buffer += chunk
        *lines, child.buffer = child.buffer.split(b"\n")
        if len(child.buffer) > _MAX_LINE:
            raise RuntimeError(f"simulation {self.runs[child.index].label}: malformed worker output")
        for line in lines:
            message = json.loads(line)
            if "share" in message and self.progress is not None:
                self.progress.update(self.first + child.index, float(message["share"]))
            elif "summary" in message:
                child.summary = message["summary"]
            elif "error" in message:
                child.error = str(message["error"])

    def _close(self, child: _Child) -> None:
        self.selector.unregister(child.fd)
        os.close(child.fd)
        del self.children[child.fd]
        _, status = os.waitpid(child.pid, 0)
        label = self.runs[child.index].label
        if child.summary is None:
            why = child.error or f"its worker exited with status {os.waitstatus_to_exitcode(status)}"
            raise RuntimeError(f"simulation {label} failed: {why}")
        self.outcomes[child.index] = RunOutcome(child.summary, None)
        if self.progress is not None:
            self.progress.done(self.first + child.index)

    def _reap_all(self) -> None:
        """Children still running when the parent gives up (an error, Ctrl-C) are stopped."""
        for child in list(self.children.values()):
            try:
                os.kill(child.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            os.waitpid(child.pid, 0)
            self.selector.unregister(child.fd)
            os.close(child.fd)
        self.children.clear()


def _send(fd: int, message: dict[str, object]) -> None:
    data = (json.dumps(message) + "\n").encode()
    while data:
        data = data[os.write(fd, data):]
