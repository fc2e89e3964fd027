"""In-flight panel: one row per request the daemon holds, oldest first: request id,
adapter, state (queued, prefill, decode, held), tokens generated so far and age.

Reads `in_flight` (list of {id, adapter, state, tokens, age_s}, at most the daemon's
IN_FLIGHT_ROWS oldest) and `in_flight_total` (all of them). Ages are as of the
snapshot plus the View's age, so they keep moving between snapshots.
"""
from __future__ import annotations

from typing import Any

from rich.console import Group, RenderableType
from rich.text import Text

from loraplex.tui.format import MISSING, fmt_count, fmt_duration, num, rows
from loraplex.tui.panels.base import DIM, GOOD, WARN, PanelSpec, compact_table, note
from loraplex.tui.view import View

COLUMNS = (("request", "left"), ("adapter", "left"), ("state", "left"), ("tokens", "right"), ("age", "right"))
STATE_STYLES = {"decode": GOOD, "prefill": GOOD, "queued": WARN, "held": WARN}


def state_cell(value: Any) -> Text:
    state = str(value) if value is not None else MISSING
    return Text(state, style=STATE_STYLES.get(state, ""))


def age_cell(value: Any, view: View) -> str:
    age = num(value)
    if age is None:
        return MISSING
    return fmt_duration(age + (view.age_s or 0.0))


def render_in_flight(view: View, width: int, height: int) -> RenderableType:
    stats = view.stats
    if "in_flight" not in stats:
        return note("request list n/a (not reported by this daemon)")
    requests = rows(stats.get("in_flight"))
    total = num(stats.get("in_flight_total"))
    if not requests:
        return Text("no requests in flight", style=DIM)
    body: list[list[RenderableType]] = [
        [str(r.get("id", MISSING)), str(r.get("adapter") or "<base>"), state_cell(r.get("state")),
         fmt_count(r.get("tokens")), age_cell(r.get("age_s"), view)]
        for r in requests]
    unlisted = int(total) - len(requests) if total is not None and total > len(requests) else 0
    if unlisted and height > 2:  # the daemon listed only the oldest: say how many more it holds
        return Group(compact_table(COLUMNS, body, height - 1), note(f"+{unlisted} more in flight not listed"))
    return compact_table(COLUMNS, body, height)


PANEL = PanelSpec("inflight", "In flight", render_in_flight)
