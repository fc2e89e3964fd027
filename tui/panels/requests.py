"""Requests panel: running and waiting, TTFT/TPT percentiles, SLO attainment, recent errors.

Reads running, waiting, completed, errors, latency.*, slo_attainment and
recent_errors; request and token rates come from the History.
"""
from __future__ import annotations

import time
from typing import Any

from rich.console import RenderableType
from rich.text import Text

from loraplex.tui.format import MISSING, fmt_count, fmt_ms, fmt_pct, fmt_rate, latency_ms, num, rows
from loraplex.tui.panels.base import BAD, DIM, GOOD, LABEL, WARN, PanelSpec, kv, lines
from loraplex.tui.view import View

SLO_GOOD = 0.99
SLO_WARN = 0.90


def latency_line(label: str, stats: Any, key: str) -> Text:
    text = Text(f"{label:<5}", style=LABEL)
    text.append("p50 ", style=DIM).append(f"{fmt_ms(latency_ms(stats, key, 'p50')):>7}")
    text.append("  p99 ", style=DIM).append(f"{fmt_ms(latency_ms(stats, key, 'p99')):>7}")
    return text


def slo_style(value: float | None) -> str:
    if value is None:
        return ""
    return GOOD if value >= SLO_GOOD else WARN if value >= SLO_WARN else BAD


def error_line(entry: Any) -> Text:
    when = num(entry.get("time"))
    stamp = time.strftime("%H:%M:%S", time.localtime(when)) if when is not None else str(entry.get("time", ""))
    text = Text(f"{stamp} ", style=DIM)
    text.append(str(entry.get("code", "?")), style=BAD)
    text.append(f" {entry.get('message', '')}")
    return text


def render_requests(view: View, width: int, height: int) -> RenderableType:
    s = view.stats
    slo = num(s.get("slo_attainment"))
    slo_text = Text("SLO ", style=DIM).append(fmt_pct(slo), style=slo_style(slo))
    slo_text.append("  " + fmt_rate(view.history.rate("requests"), " req/s"))
    slo_text.append("  " + fmt_rate(view.history.rate("tokens"), " tok/s"))
    out = [
        kv(("run", fmt_count(s.get("running"))), ("wait", fmt_count(s.get("waiting"))),
           ("done", fmt_count(s.get("completed"))), ("err", fmt_count(s.get("errors")))),
        latency_line("TTFT", s, "ttft_ms"),
        latency_line("TPT", s, "tpt_ms"),
        *([latency_line("E2E", s, "e2e_ms")] if height >= 6 else []),
        slo_text,
    ]
    room = height - len(out)
    errors = rows(s.get("recent_errors"))
    if errors and room > 0:
        out.extend(error_line(e) for e in reversed(errors[-room:]))  # newest first
    elif room > 0:
        out.append(Text("recent errors: " + ("none" if "recent_errors" in s else MISSING), style=DIM))
    return lines(out, height)


PANEL = PanelSpec("requests", "Requests", render_requests)
