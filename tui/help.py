"""The help screen: what each key does and what each panel shows.

Owns only the text and the modal that displays it; the key table is built
from the app's bindings and the action table, so it cannot drift from them.
"""
from __future__ import annotations

from collections.abc import Iterable

from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Button, Static

PANEL_HELP = (
    ("Daemon health", "link state, uptime, engine process, restarts, preemptions, draining"),
    ("Requests", "running/waiting, TTFT and TPT p50/p99, SLO attainment, req/s, tok/s, recent errors"),
    ("Queues", "per lane: depth, token quota used/total, oldest wait, WRS cut-off"),
    ("Cache", "pool pages (adapter cache / KV / free), hit rate, evictions/s, resident adapters"),
    ("PCIe", "H2D and D2H MB/s over the last minutes, % of measured link bandwidth, by purpose"),
    ("Workers", "CPU LoRA pool: busy %, tokens/s and restarts per worker"),
    ("Engines", "step time, batch size and pool use per engine; tokens/s sparkline"),
)
NOTES = ("Every admin action asks for confirmation before anything is sent. "
         "'—' means the daemon does not report that value. When the daemon goes away the "
         "console shows DISCONNECTED and reconnects by itself.")


def help_table(keys: Iterable[tuple[str, str]]) -> Table:
    table = Table(box=None, padding=(0, 2), show_header=False)
    table.add_column(style="bold cyan", no_wrap=True)
    table.add_column()
    for key, text in keys:
        table.add_row(key, text)
    return table


class HelpScreen(ModalScreen[None]):
    """Keys and panels; Escape, q, ? or the Close button return to the console."""

    DEFAULT_CSS = """
    HelpScreen { align: center middle; }
    HelpScreen > VerticalScroll {
        width: 90; max-width: 100%; height: auto; max-height: 100%;
        border: thick $accent; background: $surface; padding: 0 1;
    }
    HelpScreen .title { text-style: bold; }
    HelpScreen Button { margin-top: 1; }
    """
    BINDINGS = [Binding("escape,q,question_mark,f1", "close", "Close")]

    def __init__(self, keys: Iterable[tuple[str, str]]) -> None:
        super().__init__()
        self.keys = list(keys)

    def compose(self) -> ComposeResult:
        with VerticalScroll():
            yield Static("loraplex top — help", classes="title")
            yield Static(Text("Keys", style="bold underline"))
            yield Static(help_table(self.keys))
            yield Static(Text("Panels", style="bold underline"))
            yield Static(help_table(PANEL_HELP))
            yield Static(Text(NOTES, style="dim"))
            yield Button("Close", id="close")

    def on_button_pressed(self, event: Button.Pressed) -> None:
        event.stop()
        self.dismiss(None)

    def action_close(self) -> None:
        self.dismiss(None)
