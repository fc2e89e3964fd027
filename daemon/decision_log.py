"""The scheduling decision log: one JSON line per planned step — which engine, which
requests it admitted (their first chunk, from position 0) and which it ran — written
when `server.decision_log` names a file, and by `loraplex sim --decision-log` for a
simulated trace in the same format, so a live run and a simulation of its trace can
be compared line by line. Off by default. Torch-free.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, Iterable


@dataclass(frozen=True, slots=True)
class StepDecision:
    engine: int
    step: int
    admitted: tuple[str, ...]  # client request ids whose prefill starts in this step
    rows: tuple[str, ...]  # client request ids of every row of the step, in plan order
    merged_adapter: str | None = None


class DecisionLog:
    """Appends StepDecisions to a file, a line each (line-buffered: a reader sees whole steps)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file: IO[str] | None = self.path.open("a", encoding="utf-8", buffering=1)

    def write(self, decision: StepDecision) -> None:
        if self._file is not None:
            self._file.write(json.dumps(asdict(decision), separators=(",", ":")) + "\n")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def read_decisions(path: str | Path) -> list[StepDecision]:
    """The decisions a log holds, in order."""
    out = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        if line.strip():
            raw = json.loads(line)
            out.append(StepDecision(raw["engine"], raw["step"], tuple(raw["admitted"]), tuple(raw["rows"]),
                                    raw.get("merged_adapter")))
    return out


def write_decisions(path: str | Path, decisions: Iterable[StepDecision]) -> None:
    log = DecisionLog(path)
    try:
        for d in decisions:
            log.write(d)
    finally:
        log.close()
