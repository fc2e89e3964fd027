"""Queues panel: per scheduler lane, depth, token quota used/total, oldest wait, WRS cut-off.

Reads `queues` (list of lanes). A daemon without lanes (one FCFS queue) is
shown as a single lane holding every waiting request.
"""
from __future__ import annotations

from typing import Any

from rich.console import Group, RenderableType
from rich.text import Text

from loraplex.tui.format import MISSING, fmt_count, fmt_ms, num, rows
from loraplex.tui.panels.base import WARN, PanelSpec, compact_table, note
from loraplex.tui.view import View

COLUMNS = (("lane", "left"), ("depth", "right"), ("quota", "right"), ("oldest", "right"), ("WRS≤", "right"))
FULL_QUOTA = 0.9


def quota_cell(used: Any, total: Any) -> Text:
    u, t = num(used), num(total)
    if u is None and t is None:
        return Text(MISSING)
    text = Text(f"{fmt_count(u)}/{fmt_count(t)}")
    if u is not None and t is not None and t > 0 and u / t >= FULL_QUOTA:
        text.stylize(WARN)
    return text


def cutoff_cell(value: Any) -> str:
    v = num(value)
    return MISSING if v is None else f"{v:.3g}"


def render_queues(view: View, width: int, height: int) -> RenderableType:
    lanes = rows(view.stats.get("queues"))
    if not lanes:
        waiting = view.stats.get("waiting")
        table = compact_table(COLUMNS, [["all", fmt_count(waiting), MISSING, MISSING, MISSING]], height - 1)
        return Group(table, note("per-lane stats n/a (single queue)"))
    body = [
        [str(lane.get("name", i)), fmt_count(lane.get("depth")), quota_cell(lane.get("quota_used"),
         lane.get("quota_total")), fmt_ms(lane.get("oldest_wait_ms")), cutoff_cell(lane.get("wrs_cutoff"))]
        for i, lane in enumerate(lanes)
    ]
    return compact_table(COLUMNS, body, height)


PANEL = PanelSpec("queues", "Queues", render_queues)
