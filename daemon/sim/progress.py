"""Progress of long simulator commands (`loraplex sim`, `loraplex plan`) on stderr.

Owns the one line an operator watches: runs done, the share of the runs under way,
time spent and an estimate of the time left. On a terminal the line is rewritten in
place; elsewhere (a log, a CI job) one line every `log_every_s`. The simulations never
read a clock; this reporter does, and writes nothing to stdout (that is the result's).
"""
from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TextIO

TTY_EVERY_S = 0.5
LOG_EVERY_S = 10.0
MIN_SHARE_FOR_ESTIMATE = 0.02  # below this the estimate is noise


def fmt_s(seconds: float) -> str:
    """'8 s', '2 min 05 s', '1 h 04 min'."""
    s = max(0, round(seconds))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60:02d} s"
    return f"{s // 3600} h {s % 3600 // 60:02d} min"


class Progress:
    """`total` runs (None: not known ahead, as in the planner's search); each run reports the
    share of its work done (0..1) through `update(run, share)`; `done(run)` when it ends.
    The estimate assumes the runs left cost what the runs so far cost on average."""

    def __init__(self, command: str, total: int | None, *, stream: TextIO | None = None,
                 clock: Callable[[], float] = time.monotonic, every_s: float | None = None) -> None:
        if total is not None and total < 1:
            raise ValueError("a progress report needs at least one run")
        self.command = command
        self.total = total
        self._stream = stream if stream is not None else sys.stderr
        self._tty = bool(getattr(self._stream, "isatty", lambda: False)())
        self._every_s = every_s if every_s is not None else (TTY_EVERY_S if self._tty else LOG_EVERY_S)
        self._clock = clock
        self._started = clock()
        self._shown_at = self._started
        self._shares: dict[int, float] = {}
        self._labels: dict[int, str] = {}
        self._width = 0

    def start(self, run: int, label: str) -> None:
        self._shares[run] = 0.0
        self._labels[run] = label
        self._maybe_show()

    def update(self, run: int, share: float) -> None:
        self._shares[run] = min(1.0, max(0.0, share))
        self._maybe_show()

    def done(self, run: int) -> None:
        self._shares[run] = 1.0
        self._labels.pop(run, None)
        self._maybe_show()

    def finish(self, note: str = "") -> None:
        """The closing line: how long the whole command took."""
        runs = len(self._shares)
        self._write(f"{self.command}: {runs} run{'s' if runs != 1 else ''} in "
                    f"{fmt_s(self._clock() - self._started)}{note}", final=True)

    # ---- the line -------------------------------------------------------------------------------
    def fraction(self) -> float | None:
        """Share of the whole command done; None when the number of runs is not known."""
        if self.total is None:
            return None
        return min(1.0, sum(self._shares.values()) / self.total)

    def line(self) -> str:
        now = self._clock()
        elapsed = now - self._started
        finished = sum(1 for s in self._shares.values() if s >= 1.0)
        running = ", ".join(f"{label} {self._shares[run]:.0%}" for run, label in sorted(self._labels.items()))
        if self.total is not None:
            text = f"{self.command}: {finished}/{self.total} runs done"
        else:
            text = f"{self.command}: {finished} run{'s' if finished != 1 else ''} done"
        if running:
            text += f", running {running}"
        text += f"; {fmt_s(elapsed)} so far"
        left = self._left_s(elapsed)
        if left is not None:
            text += f", about {fmt_s(left)} left"
        return text

    def _left_s(self, elapsed: float) -> float | None:
        fraction = self.fraction()
        if fraction is not None:
            if fraction < MIN_SHARE_FOR_ESTIMATE:
                return None
            return elapsed * (1 - fraction) / fraction
        # Unknown total: the time left in the runs under way, at their own pace so far.
        shares = [self._shares[run] for run in self._labels]
        if not shares or min(shares) < MIN_SHARE_FOR_ESTIMATE:
            return None
        done_work = sum(self._shares.values())
        return elapsed / done_work * sum(1 - s for s in shares) if done_work else None

    def _maybe_show(self) -> None:
        now = self._clock()
        if now - self._shown_at >= self._every_s:
            self._shown_at = now
            self._write(self.line())

    def _write(self, text: str, *, final: bool = False) -> None:
        if self._tty:  # rewrite the line in place; pad over a longer previous one
            self._stream.write("\r" + text.ljust(self._width) + ("\n" if final else ""))
            self._width = 0 if final else len(text)
        else:
            self._stream.write(text + "\n")
        self._stream.flush()
