"""Per-row isolation of a failed step: when a step (or its sampling) raises, its rows run again
in halves to find the rows that fail alone; those fail their own requests, the rest of the
step's results stand. One request can never fail the others.

Nothing is blamed on a row unless some run without it succeeded: a step that fails for every
subset (a broken engine, a lone row) raises as before, and the daemon counts it against the
engine. Out of memory and broken tensor-parallel collectives are never isolated (their own
paths handle them). Runs only in the engine's process; never imports the daemon.
"""
from __future__ import annotations

import dataclasses
import logging
from collections import deque
from typing import Callable, Sequence, TypeVar

from loraplex.ipc.engine_plan import RowResult, StepPlan, StepResult
from loraplex.ipc.errors import ErrorCode

log = logging.getLogger("loraplex-engine")
T = TypeVar("T")
R = TypeVar("R")


def bisect_failures(run: Callable[[list[T]], R], items: Sequence[T], error: Exception,
                    passthrough: tuple[type[BaseException], ...] = ()) -> tuple[list[R], list[tuple[T, Exception]]]:
    """`run(items)` raised `error`: run the items again in halves, recursively, down to the ones
    that fail alone. Returns the results of the runs that succeeded (between them, every item but
    the guilty ones) and each guilty item with what it raised: an item is guilty when it failed
    alone twice, the second time after other runs succeeded (a fault of the whole engine that
    passes meanwhile blames nobody). Halves are tried level by level, so a run succeeds early.
    Raises `error` again when nothing can be blamed on an item: a single item, every run failing,
    or no run succeeding before 2·bit_length(n) runs failed, so a broken step costs O(log n) runs
    (up to bit_length(n) - 1 guilty items, e.g. 5 among 32, are always found first; one among n
    costs about 2·log2 n + 1 runs). `passthrough` exceptions are raised at once."""
    if len(items) < 2:
        raise error
    budget = 2 * len(items).bit_length()
    results: list[R] = []
    suspects: list[T] = []
    failures = 0
    queue = deque(_halves(list(items)))
    while queue:
        part = queue.popleft()
        try:
            results.append(run(part))
            continue
        except passthrough:
            raise
        except Exception:  # noqa: BLE001 - what a part raised is exactly what we look for
            failures += 1
            if not results and failures >= budget:
                raise error
            if len(part) == 1:
                suspects.append(part[0])
            else:
                queue.extend(_halves(part))
    if not results:  # every part failed, down to single rows: nothing points at a row
        raise error
    guilty: list[tuple[T, Exception]] = []
    for item in suspects:  # the engine ran other parts meanwhile: a row that still fails alone is guilty
        try:
            results.append(run([item]))
        except passthrough:
            raise
        except Exception as exc:  # noqa: BLE001
            guilty.append((item, exc))
    return results, guilty


def _halves(items: list[T]) -> tuple[list[T], list[T]]:
    mid = len(items) // 2
    return items[:mid], items[mid:]


# What a plan orders besides its rows, carried out before its forward: a run that got past its
# placements did them all, so the parts of its isolation do not repeat them.
_BEFORE_ROWS = ("place", "evict", "grammars")


def isolate_step(execute: Callable[[StepPlan], StepResult], plan: StepPlan, error: Exception, *,
                 placed: bool, passthrough: tuple[type[BaseException], ...] = ()) -> StepResult:
    """`execute(plan)` raised `error`: the step's result without the rows that fail alone, each of
    those an `engine_failed` row. placed: the failed run got past the plan's placements (and what
    comes before them: _BEFORE_ROWS), which the parts then leave out; else every part carries them
    again (harmless: a placement is redone in place), so a placement that fails fails every part.
    Raises `error` when no row can be blamed (bisect_failures)."""
    fields = {f.name for f in dataclasses.fields(plan)}
    stripped = dataclasses.replace(plan, **{name: [] for name in _BEFORE_ROWS if name in fields}) if placed else plan

    def run(rows):
        return execute(dataclasses.replace(stripped, rows=rows))

    results, guilty = bisect_failures(run, plan.rows, error, passthrough)
    for row, exc in guilty:
        log.error("step %d: row %s fails alone (the rest of the step ran without it): %r", plan.step_id,
                  row.request_id, exc)
    by_id = {r.request_id: r for result in results for r in result.rows}
    by_id.update({row.request_id: RowResult(
        request_id=row.request_id, token_id=0, logprob=None, error_code=ErrorCode.ENGINE_FAILED.value,
        error=f"the engine failed on this request's row; the rest of its step ran without it: {exc}")
        for row, exc in guilty})
    merged = _merged(results)
    merged.update(step_id=plan.step_id, rows=[by_id[r.request_id] for r in plan.rows if r.request_id in by_id])
    return StepResult(**merged)


def _merged(results: list[StepResult]) -> dict[str, object]:
    """The parts' results as one: times and counts added, byte counts added per purpose, lists
    joined (each entry once), except `loading`, which is what the last part left arriving."""
    merged: dict[str, object] = {}
    for f in dataclasses.fields(StepResult):
        values = [getattr(r, f.name) for r in results]
        if f.name in ("step_id", "rows"):  # the caller's
            continue
        if f.name == "loading":
            merged[f.name] = list(values[-1])
        elif f.name == "prompt_logprobs":  # each part's own rows' (records of lists: not hashable)
            merged[f.name] = [chunk for value in values for chunk in value]
        elif isinstance(values[0], (int, float)):
            merged[f.name] = sum(values)
        elif isinstance(values[0], dict):
            total: dict = {}
            for value in values:
                for key, n in value.items():
                    total[key] = total.get(key, 0) + n
            merged[f.name] = total
        elif isinstance(values[0], list):
            merged[f.name] = list(dict.fromkeys(item for value in values for item in value))
    return merged
