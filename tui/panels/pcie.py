"""PCIe panel: host-to-device and device-to-host MB/s as sparklines over the
History window, as a share of the measured link bandwidth, split by purpose.

Reads pcie{h2d_mb_s, d2h_mb_s, link_mb_s, by_purpose}; the sparklines come
from History (the last few minutes of snapshots). A daemon whose engines run on
the CPU sends no link figure (link_mb_s null): the panel says there is no GPU.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rich.console import RenderableType
from rich.text import Text

from loraplex.tui.format import MISSING, dig, fmt_duration, fmt_pct, fmt_rate, num, sparkline
from loraplex.tui.panels.base import DIM, LABEL, PanelSpec, lines, note
from loraplex.tui.view import View

DIRECTIONS = (("H2D", "h2d_mb_s", "green"), ("D2H", "d2h_mb_s", "blue"))
VALUE_CELLS = 19  # " 12.3k MB/s  45.0%"


def direction_line(view: View, label: str, key: str, style: str, width: int) -> Text:
    now = num(dig(view.stats, "pcie", key))
    link = num(dig(view.stats, "pcie", "link_mb_s"))
    share = now / link if now is not None and link else None
    spark_width = max(0, width - len(label) - 1 - VALUE_CELLS)
    text = Text(f"{label} ", style=LABEL)
    text.append(sparkline(view.history.series(f"pcie.{key}"), spark_width), style=style)
    text.append(f" {fmt_rate(now, ' MB/s'):>11} {fmt_pct(share):>6}")
    return text


def purpose_text(by_purpose: Any) -> Text:
    """'adapter 812 · kv 3.2 · x 40' (MB/s); a purpose may split into h2d/d2h."""
    text = Text("by purpose ", style=DIM)
    if not isinstance(by_purpose, Mapping) or not by_purpose:
        return text.append(MISSING)
    for i, (name, value) in enumerate(by_purpose.items()):
        if i:
            text.append(" · ", style=DIM)
        text.append(f"{name} ", style=LABEL)
        if isinstance(value, Mapping):
            text.append(f"↑{fmt_rate(value.get('h2d_mb_s', value.get('h2d')), '')} "
                        f"↓{fmt_rate(value.get('d2h_mb_s', value.get('d2h')), '')}")
        else:
            text.append(fmt_rate(value, ""))
    return text


def render_pcie(view: View, width: int, height: int) -> RenderableType:
    pcie = view.stats.get("pcie")
    out = [direction_line(view, label, key, style, width) for label, key, style in DIRECTIONS]
    out.append(purpose_text(dig(pcie, "by_purpose")))
    link = num(dig(pcie, "link_mb_s"))
    no_gpu = isinstance(pcie, Mapping) and link is None
    out.append(Text("link ", style=DIM).append("no GPU (engines on the CPU)" if no_gpu else fmt_rate(link, " MB/s"))
               .append(f"  window {fmt_duration(view.history.span_s)}", style=DIM))
    if not isinstance(pcie, Mapping):
        out.append(note("PCIe counters n/a from this daemon"))
    return lines(out, height)


PANEL = PanelSpec("pcie", "PCIe", render_pcie)
