"""Workers panel: the CPU LoRA pool, per worker state, busy %, tokens/s and restarts.

Reads `workers` (list of {index, pid, alive, ready, busy_pct, tokens_per_s,
restarts}), else the pool list under `cpu_assist.workers` (index, pid, alive,
ready, starts); tokens/s is derived from a per-worker `tokens` counter through
History when the daemon sends only the counter. Without workers it says why
(the daemon's adapter load mode runs none) rather than a bare n/a.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rich.console import Group, RenderableType
from rich.text import Text

from loraplex.contracts.engine_spec import LoadMode
from loraplex.tui.format import MISSING, dig, fmt_count, fmt_id, fmt_pct, fmt_rate, num, rows
from loraplex.tui.panels.base import BAD, GOOD, WARN, PanelSpec, compact_table, kv, note
from loraplex.tui.view import View

COLUMNS = (("#", "right"), ("pid", "right"), ("state", "left"), ("busy", "left"), ("tok/s", "right"),
           ("restarts", "right"))
BUSY_CELLS = 5


def tokens_per_s(view: View, worker: Mapping[str, Any], i: int) -> float | None:
    reported = num(worker.get("tokens_per_s"))
    if reported is not None:
        return reported
    return view.history.rate(f"workers.{worker.get('index', i)}.tokens")


def busy_cell(value: Any) -> Text:
    busy = num(value)
    if busy is None:
        return Text(MISSING)
    filled = round(max(0.0, min(100.0, busy)) / 100 * BUSY_CELLS)
    return Text("▮" * filled + "▯" * (BUSY_CELLS - filled) + f" {fmt_pct(busy, fraction=False, digits=0):>4}")


def reported_workers(stats: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """`workers`, else the CPU-assist pool's own list (restarts from its start count)."""
    workers = rows(stats.get("workers"))
    if workers:
        return workers
    pool = rows(dig(stats, "cpu_assist", "workers"))
    return [{**w, "restarts": max(0, int(num(w.get("starts")) or 1) - 1)} for w in pool]


def state_cell(worker: Mapping[str, Any]) -> Text:
    alive, ready = worker.get("alive"), worker.get("ready")
    if alive is None:
        return Text(MISSING)
    if not alive:
        return Text("down", style=BAD)
    return Text("up", style=GOOD) if ready is not False else Text("start", style=WARN)


def render_workers(view: View, width: int, height: int) -> RenderableType:
    workers = reported_workers(view.stats)
    if not workers:
        mode = view.stats.get("load_mode")
        if isinstance(mode, str) and mode != LoadMode.CPU_ASSIST:
            return Group(note(f"no CPU LoRA workers ({mode} loads)"))  # only cpu_assist runs them
        return Group(note("CPU LoRA pool n/a (not reported by this daemon)"))
    rates = [tokens_per_s(view, w, i) for i, w in enumerate(workers)]
    busy = [b for b in (num(w.get("busy_pct")) for w in workers) if b is not None]
    known = [r for r in rates if r is not None]
    summary = kv(("workers", str(len(workers))),
                 ("busy", fmt_pct(sum(busy) / len(busy), fraction=False, digits=0) if busy else MISSING),
                 ("tok/s", fmt_rate(sum(known), "") if known else MISSING))
    summary.no_wrap, summary.overflow = True, "ellipsis"
    body = []
    for w, rate in zip(workers, rates):
        restarted = num(w.get("restarts")) or 0
        body.append([fmt_id(w.get("index")), fmt_id(w.get("pid")), state_cell(w), busy_cell(w.get("busy_pct")),
                     fmt_rate(rate, ""), Text(fmt_count(w.get("restarts")), style=BAD if restarted else "")])
    if height <= 1:
        return Group(summary)
    return Group(summary, compact_table(COLUMNS, body, height - 1))


PANEL = PanelSpec("workers", "Workers", render_workers)
