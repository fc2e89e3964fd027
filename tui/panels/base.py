"""The panel contract: a titled, pure render function from a View to a Rich renderable.

Owns PanelSpec and the helpers panels share for fitting content into the
cells they are given. Never imports Textual: panels are testable with a plain
Rich console (plain_text).
"""
from __future__ import annotations

import io
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from rich.console import Console, Group, RenderableType
from rich.table import Table
from rich.text import Text

from loraplex.tui.view import View

Render = Callable[[View, int, int], RenderableType]

DIM = "dim"
LABEL = "bold"
BAD = "bold red"
GOOD = "green"
WARN = "yellow"


@dataclass(frozen=True, slots=True)
class PanelSpec:
    """id: the widget id; title: the border title an operator looks for;
    render(view, width, height): the content for a box of that many cells."""

    id: str
    title: str
    render: Render


def plain_text(renderable: RenderableType, width: int) -> str:
    """What `renderable` shows in `width` columns, without styles (tests, logs)."""
    console = Console(width=max(1, width), file=io.StringIO(), color_system=None, legacy_windows=False,
                      force_terminal=False, no_color=True)
    with console.capture() as capture:
        console.print(renderable)
    return capture.get()


def lines(items: Sequence[Text], height: int) -> Group:
    """At most `height` one-line Texts, each cut to one line."""
    kept = list(items[:max(1, height)])
    for text in kept:
        text.no_wrap = True
        text.overflow = "ellipsis"
    return Group(*kept)


def kv(*pairs: tuple[str, str], style: str = "") -> Text:
    """'label value  label value' with dim labels."""
    text = Text()
    for i, (label, value) in enumerate(pairs):
        if i:
            text.append("  ")
        if label:
            text.append(label + " ", style=DIM)
        text.append(value, style=style)
    return text


def compact_table(columns: Sequence[tuple[str, str]], body: Sequence[Sequence[RenderableType]],
                  height: int) -> RenderableType:
    """A header + rows table in at most `height` lines; when rows are cut, the
    last line says how many are hidden. columns: (header, justify)."""
    table = Table(box=None, padding=(0, 1, 0, 0), pad_edge=False, show_edge=False, header_style="bold")
    for header, justify in columns:
        table.add_column(header, justify=justify, no_wrap=True, overflow="ellipsis")  # type: ignore[arg-type]
    room = max(0, height - 1)
    shown = body if len(body) <= room else body[:max(0, room - 1)]
    for row in shown:
        table.add_row(*row)
    hidden = len(body) - len(shown)
    if hidden > 0 and height > 1:
        return Group(table, note(f"+{hidden} more"))
    return table


def note(message: str) -> Text:
    return Text(message, style=DIM, no_wrap=True, overflow="ellipsis")
