"""The Textual widget that shows one panel: a bordered box titled for the
operator, redrawn from the latest View at whatever size it is given.

Owns only the glue between a PanelSpec's pure render function and Textual;
a render failure (an unexpected value in a snapshot) is shown in the box,
never raised into the app.
"""
from __future__ import annotations

import logging

from rich.console import RenderableType
from rich.text import Text
from textual.widget import Widget

from loraplex.tui.panels import PanelSpec, plain_text
from loraplex.tui.view import View

log = logging.getLogger(__name__)


class PanelWidget(Widget):
    DEFAULT_CSS = """
    PanelWidget {
        border: round $primary;
        border-title-color: $accent;
        border-title-style: bold;
        padding: 0 0 0 1;
        height: 1fr;
    }
    PanelWidget.stale { border: round $error; text-opacity: 60%; }
    """

    def __init__(self, spec: PanelSpec) -> None:
        super().__init__(id=spec.id)
        self.spec = spec
        self.border_title = spec.title
        self._view = View()

    def show(self, view: View) -> None:
        """Redraw from `view` (Textual coalesces refreshes into one paint)."""
        self._view = view
        self.refresh()

    def render(self) -> RenderableType:
        size = self.content_size
        try:
            return self.spec.render(self._view, max(1, size.width), max(1, size.height))
        except Exception as exc:  # a snapshot we do not understand must not take the console down
            log.exception("panel %s failed to render", self.spec.id)
            return Text(f"cannot render: {exc!r}", style="red")

    def plain_text(self) -> str:
        """What the panel shows right now, without styles or border."""
        return plain_text(self.render(), max(1, self.content_size.width))
