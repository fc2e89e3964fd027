"""The `loraplex top` application: layout, key bindings, the feed consumer and
the admin plumbing.

Owns the App. It reads a Feed in an async worker (the UI never waits on ZMQ),
keeps the History, fans a fresh View out to the panels, polls the admin
socket for the adapter list and runs admin actions once confirmed. Feed and
admin client are injected, so tests drive it with fakes. Never imports torch.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from rich.markup import escape
from textual import events
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Grid
from textual.widgets import Footer

from loraplex.ipc.errors import LoraplexError
from loraplex.tui.actions import ACTIONS, AdminAction, AdminApi
from loraplex.tui.feed import Disconnected, Feed, FeedEvent, Snapshot
from loraplex.tui.format import dig, num
from loraplex.tui.help import HelpScreen
from loraplex.tui.history import History
from loraplex.tui.modals import ActionForm, Confirm
from loraplex.tui.panel_widget import PanelWidget
from loraplex.tui.panels import HEALTH, PANELS
from loraplex.tui.view import Link, View

WIDE_COLUMNS = 150  # from this terminal width up the grid has three columns
TALL_ROWS = 36  # below this terminal height panels drop their side and bottom borders
ADMIN_POLL_TIMEOUT_S = 2.0
# Above this many registered adapters (stats.adapter_counts.total) the full admin list is fetched only
# after an action, not every poll: at 10,000 names each listing costs the daemon's loop ~0.3 s.
LIST_POLL_MAX_ADAPTERS = 256


class LoraplexTop(App[None]):
    """The console. feed: where snapshots come from; admin: an AsyncAdminClient
    (or a fake), None for a read-only console; target: what the health strip
    says it is connecting to; clock: monotonic seconds (fixed in snapshot tests)."""

    TITLE = "loraplex top"
    ENABLE_COMMAND_PALETTE = False
    CSS = """
    #health { height: 4; }
    #grid { layout: grid; grid-size: 2; grid-gutter: 0; height: 1fr; }
    #grid.wide { grid-size: 3; }
    #inflight { column-span: 2; display: none; }
    #grid.wide #inflight { column-span: 3; }
    #grid.requests #inflight { display: block; }
    Screen.compact PanelWidget { border: none; border-top: round $primary; padding: 0 1 0 1; }
    Screen.compact PanelWidget.stale { border-top: round $error; }
    Screen.compact #health { height: 2; }
    """
    BINDINGS = [
        Binding("q", "quit", "Quit"),
        Binding("ctrl+c", "quit", "Quit", show=False, priority=True),
        Binding("question_mark,f1", "help", "Help", key_display="?"),
        Binding("l", "toggle_requests", "Requests"),
        *(Binding(a.key, f"admin('{a.name}')", a.name.capitalize()) for a in ACTIONS.values()),
    ]

    def __init__(self, feed: Feed, admin: AdminApi | None = None, *, target: str = "",
                 clock: Callable[[], float] = time.monotonic, tick_s: float = 0.25,
                 adapters_poll_s: float = 2.0, history: History | None = None) -> None:
        super().__init__()
        self.feed = feed
        self.admin = admin
        self.target = target
        self._clock = clock
        self._tick_s = tick_s
        self._adapters_poll_s = adapters_poll_s
        self.history = history if history is not None else History()
        self._stats: Mapping[str, Any] = {}
        self._link = Link.CONNECTING
        self._reason = ""
        self._last_at: float | None = None
        self._adapters: tuple[Mapping[str, Any], ...] | None = None
        self._admin_error: str | None = None
        self._polling = False
        self._closed = False
        self._tall = False
        self._requests_shown: bool | None = None  # None: by the terminal's height

    # -- layout -------------------------------------------------------------

    def compose(self) -> ComposeResult:
        # Kept as references: while a dialog is open, queries would search the dialog's screen.
        self._health = PanelWidget(HEALTH)
        self._panels = [self._health, *(PanelWidget(spec) for spec in PANELS)]
        self._grid = Grid(*self._panels[1:], id="grid")
        yield self._health
        yield self._grid
        yield Footer()

    def panel(self, panel_id: str) -> PanelWidget:
        """The panel widget with that id (also while a dialog covers it)."""
        return next(p for p in self._panels if p.id == panel_id)

    def on_mount(self) -> None:
        self.run_worker(self._consume(), name="stats feed", group="feed")
        self.set_interval(self._tick_s, self._tick)
        if self.admin is not None:
            self.set_interval(self._adapters_poll_s, self._poll_adapters)
            self._poll_adapters()
        self._push_view()

    def on_resize(self, event: events.Resize) -> None:
        self._grid.set_class(event.size.width >= WIDE_COLUMNS, "wide")
        self._grid.screen.set_class(event.size.height < TALL_ROWS, "compact")
        self._tall = event.size.height >= TALL_ROWS
        self._place_requests()

    def _place_requests(self) -> None:
        """The in-flight list shows in tall terminals (in short ones it would squeeze every
        panel) or when asked for with `l`; `l` again hides it."""
        shown = self._tall if self._requests_shown is None else self._requests_shown
        self._grid.set_class(shown, "requests")

    def requests_shown(self) -> bool:
        return self._grid.has_class("requests")

    def action_toggle_requests(self) -> None:
        self._requests_shown = not self.requests_shown()
        self._place_requests()

    # -- data ---------------------------------------------------------------

    async def _consume(self) -> None:
        async for event in self.feed.events():
            self.apply(event)

    def apply(self, event: FeedEvent) -> None:
        """Take one feed event into the state and redraw."""
        if isinstance(event, Snapshot):
            self._stats = event.stats
            self._last_at = self._clock()
            self._link, self._reason = Link.LIVE, ""
            self.history.add(event.stats, event.received)
        elif isinstance(event, Disconnected):
            self._link, self._reason = Link.DISCONNECTED, event.reason
        self._push_view()

    def view(self) -> View:
        age = None if self._last_at is None else max(0.0, self._clock() - self._last_at)
        return View(stats=self._stats, history=self.history, link=self._link, reason=self._reason,
                    target=self.target, age_s=age, adapters=self._adapters, admin_error=self._admin_error)

    def _push_view(self) -> None:
        view = self.view()
        stale = self._link is Link.DISCONNECTED
        for panel in self._panels:
            panel.set_class(stale, "stale")
            panel.show(view)

    def _tick(self) -> None:
        """Age and link state move with time even when no snapshot arrives."""
        self._health.show(self.view())

    def _poll_adapters(self, *, force: bool = False) -> None:
        total = num(dig(self._stats, "adapter_counts", "total"))
        if not force and self._adapters is not None and total is not None and total > LIST_POLL_MAX_ADAPTERS:
            return  # the cache panel shows the tier counts; names come after an action
        if self.admin is not None and not self._polling and not self._closed:
            self._polling = True
            self.run_worker(self._fetch_adapters(self.admin), name="adapter list", group="admin-poll")

    async def _fetch_adapters(self, admin: AdminApi) -> None:
        try:
            infos = await admin.adapters(timeout=ADMIN_POLL_TIMEOUT_S)
            self._adapters = tuple({"name": a.name, "path": a.path, "rank": a.rank, "state": a.state, **a.extra}
                                   for a in infos)
            self._admin_error = None
        except LoraplexError as exc:
            self._admin_error = exc.code.value
        finally:
            self._polling = False
        self._push_view()

    def adapter_names(self) -> list[str]:
        names = {str(a.get("name")) for a in self._adapters or ()}
        names.update(n for n in self._stats.get("resident_adapters") or () if isinstance(n, str))
        return sorted(names)

    # -- actions ------------------------------------------------------------

    def key_help(self) -> list[tuple[str, str]]:
        keys = [("q, ctrl+c", "quit"), ("?, F1", "this help"),
                ("l", "show or hide the list of requests in flight (shown by default from "
                      f"{TALL_ROWS} rows up)")]
        keys += [(a.key, f"{a.title.lower()} (asks, then confirms)") for a in ACTIONS.values()]
        keys += [("tab, enter, esc", "move between fields, submit, cancel in dialogs"),
                 ("y / n", "answer a confirmation"),
                 ("mouse", "click the keys in the footer and the dialog buttons")]
        return keys

    def _dialog_open(self) -> bool:
        return self.screen is not self._grid.screen

    def action_help(self) -> None:
        if not self._dialog_open():
            self.push_screen(HelpScreen(self.key_help()))

    def action_admin(self, name: str) -> None:
        if self._dialog_open():
            return  # one dialog at a time: a key pressed in a dialog never starts another action
        if self.admin is None:
            self.notify("read-only console: no admin connection", severity="error")
            return
        self.run_worker(self._run_action(ACTIONS[name], self.admin), name=f"admin {name}", group="actions")

    async def _run_action(self, action: AdminAction, admin: AdminApi) -> None:
        values = await self.push_screen_wait(ActionForm(action, self.adapter_names()))
        if values is None:
            return
        if not await self.push_screen_wait(Confirm(action.confirm(values), action.title)):
            self.notify(f"{action.title}: cancelled", timeout=3)
            return
        try:
            detail = await action.call(admin, values)
        except (LoraplexError, ValueError) as exc:  # ValueError: refused before sending (ProtocolError)
            code = getattr(getattr(exc, "code", None), "value", "invalid")
            self.notify(escape(f"{action.title} failed ({code}): {getattr(exc, 'message', exc)}"),
                        severity="error", timeout=10)
            return
        self.notify(escape(action.done(values, detail)), title=action.title, timeout=5)
        self._poll_adapters(force=True)

    async def action_quit(self) -> None:
        await self.close_connections()
        self.exit()

    async def close_connections(self) -> None:
        if self._closed:
            return
        self._closed = True
        await self.feed.close()
        if self.admin is not None:
            await self.admin.close()

    async def on_unmount(self) -> None:
        await self.close_connections()


def run_top(runtime_dir: str | Path | None = None) -> int:
    """`loraplex top`: the console against the daemon owning `runtime_dir`."""
    from loraplex.ipc.client import AsyncAdminClient
    from loraplex.ipc.runtime_dir import default_runtime_dir, endpoints
    from loraplex.tui.feed import StatsFeed

    directory = Path(runtime_dir) if runtime_dir is not None else default_runtime_dir()
    eps = endpoints(directory)
    app = LoraplexTop(StatsFeed(eps.stats), AsyncAdminClient(eps.admin), target=str(directory))
    app.run()
    return 0
