"""Daemon health strip: link state, uptime, engine process, restarts, draining or paused.

Reads the View's link state and age, uptime_s, engine{index,pid,alive,starts,
device,num_pages}, engine_restarts, preemptions, draining and the admin
socket's last error.
"""
from __future__ import annotations

from rich.console import RenderableType
from rich.text import Text

from loraplex.tui.format import MISSING, dig, fmt_count, fmt_duration, fmt_id, fmt_text, num
from loraplex.tui.panels.base import BAD, DIM, GOOD, LABEL, WARN, PanelSpec, kv, lines
from loraplex.tui.view import Link, View

STALE_AFTER_S = 2.0


def link_text(view: View) -> Text:
    if view.link is Link.LIVE:
        age = view.age_s
        stale = age is not None and age > STALE_AFTER_S
        text = Text("● LIVE", style=WARN if stale else GOOD)
        if stale:
            text.append(f" {age:.1f}s ago", style=DIM)
        return text
    if view.link is Link.CONNECTING:
        return Text("◌ CONNECTING", style=WARN).append(f" {view.target}", style=DIM)
    text = Text("✖ DISCONNECTED", style=BAD)
    text.append(f" {view.reason or 'no stats'}; reconnecting", style="")
    if view.age_s is not None:
        text.append(f" (last data {fmt_duration(view.age_s)} ago)", style=DIM)
    return text


def engine_text(view: View) -> Text:
    s = view.stats
    engine = s.get("engine")
    alive = dig(engine, "alive")
    text = Text("engine ", style=DIM)
    text.append(f"#{fmt_id(dig(engine, 'index'))} ")
    text.append("up" if alive else "down" if alive is not None else MISSING,
                style=GOOD if alive else BAD if alive is not None else "")
    text.append(f" pid {fmt_id(dig(engine, 'pid'))} {fmt_text(dig(engine, 'device'), '?')}")
    tp = num(dig(engine, "tensor_parallel_size"))
    if tp is not None and tp > 1:  # one engine over N rank processes (devices)
        text.append(f" ×{tp:.0f} ranks")
    text.append("  ")
    restarts = num(s.get("engine_restarts"))
    text.append_text(kv(("restarts", fmt_count(restarts)), style=WARN if restarts else ""))
    text.append("  ").append_text(kv(("preempt", fmt_count(s.get("preemptions")))))
    if view.admin_error:
        text.append("  admin: ", style=DIM).append(view.admin_error, style=BAD)
    return text


def render_health(view: View, width: int, height: int) -> RenderableType:
    """Two lines (link and totals; engine) when there is room, else one line
    with the most important of both."""
    s = view.stats
    first = link_text(view)
    first.stylize(LABEL, 0, 1)
    if not s:
        return lines([first], height)
    first.append("  ").append_text(kv(("up", fmt_duration(s.get("uptime_s")))))
    if s.get("draining"):
        first.append("  DRAINING", style=BAD)
    elif s.get("paused"):
        first.append("  PAUSED", style=BAD)
    if height == 1:
        return lines([first.append("  ").append_text(engine_text(view))], 1)
    first.append("  ").append_text(kv(("requests", fmt_count(s.get("requests"))), ("steps", fmt_count(s.get("steps")))))
    return lines([first, engine_text(view)], height)


PANEL = PanelSpec("health", "Daemon health", render_health)
