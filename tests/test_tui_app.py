"""`loraplex top` under Textual's pilot with a fake stats feed and a fake
admin client: panels show the numbers, the disconnected state shows and
recovers, actions send the right admin calls only after confirmation, help
opens, and small and large terminals render."""
from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest

from loraplex.tui.app import TALL_ROWS, WIDE_COLUMNS, LoraplexTop
from loraplex.tui.feed import QueueFeed
from loraplex.tui.help import HelpScreen
from loraplex.tui.modals import ActionForm, Confirm
from loraplex.tui.panel_widget import PanelWidget
from tests.test_tui_support import FakeAdmin, base_snapshot, full_snapshot, not_found, screen_text

TITLES = ("Daemon health", "Requests", "Queues", "Cache", "PCIe", "Workers", "Engines", "In flight")


def run(scenario, *, admin: FakeAdmin | None = None, size=(100, 40), **kw):
    """Run `scenario(app, pilot, feed)` inside a headless app; returns the app."""
    feed = QueueFeed()
    kw.setdefault("adapters_poll_s", 5.0)
    app = LoraplexTop(feed, admin, target="/run/lpx", **kw)

    async def main() -> None:
        async with app.run_test(size=size) as pilot:
            await scenario(app, pilot, feed)

    asyncio.run(main())
    return app


def panel(app: LoraplexTop, panel_id: str) -> str:
    return app.panel(panel_id).plain_text()


async def feed_snapshots(pilot, feed: QueueFeed, snapshots) -> None:
    for i, snapshot in enumerate(snapshots):
        feed.snapshot(snapshot, received=float(i))
    await consumed(pilot, feed)


async def consumed(pilot, feed: QueueFeed) -> None:
    """Until the app took every event (it applies each as it takes it) and repainted."""
    await settle(pilot, lambda: feed.pending == 0)
    await pilot.pause()


async def settle(pilot, predicate, timeout: float = 3.0) -> None:
    """Let the app run until `predicate()` holds (workers and timers are real)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        if loop.time() > deadline:
            raise AssertionError("condition not reached in time")
        await pilot.pause(0.02)


def test_panels_render_the_snapshot_values():
    async def scenario(app, pilot, feed):
        await feed_snapshots(pilot, feed, [full_snapshot(uptime=100.0 + i, tokens=1000 + 300 * i)
                                           for i in range(4)])
        assert "LIVE" in panel(app, "health") and "pid 42421" in panel(app, "health")
        assert "TTFT" in panel(app, "requests") and "88.2ms" in panel(app, "requests")
        assert "SLO 97.5%" in panel(app, "requests") and "300 tok/s" in panel(app, "requests")
        assert "900/1000" in panel(app, "queues")
        assert "hit 87.5%" in panel(app, "cache") and "0.91" in panel(app, "cache")
        assert "812 MB/s" in panel(app, "pcie")
        assert "5003" in panel(app, "workers")
        assert "70.0%" in panel(app, "engines")
        assert [w.border_title for w in app.query(PanelWidget)] == list(TITLES)

    run(scenario)


def test_disconnected_state_shows_then_recovers():
    async def scenario(app, pilot, feed):
        assert "CONNECTING" in panel(app, "health")
        await feed_snapshots(pilot, feed, [base_snapshot(uptime=50.0)])
        assert "LIVE" in panel(app, "health")
        feed.disconnect("no daemon: /run/lpx/stats.sock does not exist")
        await consumed(pilot, feed)
        health = panel(app, "health")
        assert "DISCONNECTED" in health and "does not exist" in health
        assert all(w.has_class("stale") for w in app.query(PanelWidget))
        assert "run 7" in panel(app, "requests")  # the last values stay visible, dimmed
        feed.snapshot(base_snapshot(uptime=2.0, tokens=5), received=10.0)  # the daemon restarted
        await consumed(pilot, feed)
        assert "LIVE" in panel(app, "health") and "up 2s" in panel(app, "health")
        assert not any(w.has_class("stale") for w in app.query(PanelWidget))
        assert len(app.history) == 1  # counters from before the restart are not mixed in

    run(scenario)


def test_a_stale_stream_is_flagged_by_age():
    now = [100.0]

    async def scenario(app, pilot, feed):
        await feed_snapshots(pilot, feed, [base_snapshot()])
        now[0] += 7.0
        await pilot.pause(0.4)  # a tick redraws the health strip
        assert "7.0s ago" in panel(app, "health")

    run(scenario, clock=lambda: now[0], tick_s=0.05)


async def open_form(app, pilot, key: str) -> ActionForm:
    await pilot.press(key)
    await settle(pilot, lambda: isinstance(app.screen, ActionForm))
    return app.screen


async def type_text(pilot, text: str) -> None:
    await pilot.press(*[{" ": "space", "/": "slash", "-": "minus", ".": "full_stop"}.get(c, c) for c in text])


def fill(form: ActionForm, **values: str) -> None:
    """Set form fields directly (typing every key through the pilot is slow)."""
    for key, value in values.items():
        form.query_one(f"#field-{key}").value = value


def test_pin_asks_confirms_and_sends():
    admin = FakeAdmin()

    async def scenario(app, pilot, feed):
        await feed_snapshots(pilot, feed, [base_snapshot()])
        await open_form(app, pilot, "p")
        await type_text(pilot, "qv-r8")
        await pilot.press("enter")
        await settle(pilot, lambda: isinstance(app.screen, Confirm))
        confirm = app.screen
        assert "qv-r8" in confirm.question
        await pilot.press("r")  # another action's key inside a dialog starts nothing
        assert app.screen is confirm
        assert admin.calls == []  # nothing sent before the answer
        await pilot.press("y")
        await settle(pilot, lambda: admin.calls)
        assert admin.calls == [("pin_adapter", ("qv-r8", True))]

    run(scenario, admin=admin)


def test_declining_the_confirmation_sends_nothing():
    admin = FakeAdmin()

    async def scenario(app, pilot, feed):
        fill(await open_form(app, pilot, "r"), name="qv-r8")
        await pilot.press("enter")
        await settle(pilot, lambda: isinstance(app.screen, Confirm))
        await pilot.press("n")
        await settle(pilot, lambda: not isinstance(app.screen, Confirm))
        await pilot.pause(0.1)
        assert admin.calls == []
        await open_form(app, pilot, "r")  # escape in the form also sends nothing
        await pilot.press("escape")
        await settle(pilot, lambda: not isinstance(app.screen, ActionForm))
        assert admin.calls == []

    run(scenario, admin=admin)


def test_add_adapter_with_mouse_clicks():
    admin = FakeAdmin()

    async def scenario(app, pilot, feed):
        fill(await open_form(app, pilot, "a"), name="extra", path="/adapters/extra")
        await pilot.click("#ok")
        await settle(pilot, lambda: isinstance(app.screen, Confirm))
        await pilot.click("#yes")
        await settle(pilot, lambda: admin.calls)
        assert admin.calls == [("add_adapter", ("extra", "/adapters/extra"))]

    run(scenario, admin=admin)


def test_drain_unpin_and_policy_send_their_messages():
    admin = FakeAdmin()

    async def scenario(app, pilot, feed):
        await open_form(app, pilot, "d")
        await pilot.press("enter")  # default timeout 30 s
        await settle(pilot, lambda: isinstance(app.screen, Confirm))
        await pilot.press("y")
        await settle(pilot, lambda: len(admin.calls) == 1)
        fill(await open_form(app, pilot, "u"), name="all-r32")
        await pilot.press("enter")
        await settle(pilot, lambda: isinstance(app.screen, Confirm))
        await pilot.click("#yes")
        await settle(pilot, lambda: len(admin.calls) == 2)
        fill(await open_form(app, pilot, "s"), kind="cache", name="lru")
        await pilot.click("#ok")
        await settle(pilot, lambda: isinstance(app.screen, Confirm))
        assert "cache policy" in app.screen.question
        await pilot.press("y")
        await settle(pilot, lambda: len(admin.calls) == 3)
        assert admin.calls == [("drain", (30.0,)), ("unpin_adapter", ("all-r32",)), ("set_policy", ("cache", "lru"))]

    run(scenario, admin=admin)


def test_invalid_input_is_explained_in_the_form():
    admin = FakeAdmin()

    async def scenario(app, pilot, feed):
        form = await open_form(app, pilot, "d")
        form.query_one("#field-timeout_s").value = "soon"
        await pilot.press("enter")
        await pilot.pause(0.05)
        assert app.screen is form and "number" in str(form.query_one("#form-error").render())
        form.query_one("#field-timeout_s").value = ""
        await pilot.click("#ok")
        assert app.screen is form and "required" in str(form.query_one("#form-error").render())
        await pilot.click("#cancel")
        await settle(pilot, lambda: app.screen is not form)
        assert admin.calls == []

    run(scenario, admin=admin)


def test_a_refused_action_is_reported_not_raised():
    admin = FakeAdmin()
    admin.fail = not_found("unknown adapter 'nope' [really]")

    async def scenario(app, pilot, feed):
        fill(await open_form(app, pilot, "p"), name="nope")
        await pilot.press("enter")
        await settle(pilot, lambda: isinstance(app.screen, Confirm))
        await pilot.press("y")
        await settle(pilot, lambda: app._notifications)
        (note,) = list(app._notifications)
        assert note.severity == "error" and "not_found" in note.message and "[really]" in note.message

    run(scenario, admin=admin)


def test_admin_poll_fills_the_cache_table_and_suggestions():
    admin = FakeAdmin()

    async def scenario(app, pilot, feed):
        await feed_snapshots(pilot, feed, [base_snapshot()])
        await settle(pilot, lambda: app.view().adapters is not None)
        await pilot.pause()
        row = next(line for line in panel(app, "cache").splitlines() if line.startswith("qv-r8"))
        assert row.split()[:4] == ["qv-r8", "8", "16", "2"]
        assert app.adapter_names() == ["all-r32", "mlp-r64", "qv-r8"]

    run(scenario, admin=admin)


def test_read_only_console_refuses_actions():
    async def scenario(app, pilot, feed):
        await pilot.press("a")
        await pilot.pause(0.05)
        assert not isinstance(app.screen, ActionForm)
        assert any("read-only" in n.message for n in app._notifications)

    run(scenario, admin=None)


def test_panels_keep_updating_under_a_dialog():
    async def scenario(app, pilot, feed):
        await pilot.press("question_mark")
        await settle(pilot, lambda: isinstance(app.screen, HelpScreen))
        await feed_snapshots(pilot, feed, [base_snapshot()])
        await pilot.pause(0.1)  # a few ticks of the health strip
        assert "LIVE" in panel(app, "health") and "run 7" in panel(app, "requests")

    run(scenario, tick_s=0.02)


def test_help_opens_and_closes():
    async def scenario(app, pilot, feed):
        await pilot.press("question_mark")
        await settle(pilot, lambda: isinstance(app.screen, HelpScreen))
        text = screen_text(app)
        assert "pin adapter" in text and "Cache" in text and "drain daemon" in text
        await pilot.press("escape")
        await settle(pilot, lambda: not isinstance(app.screen, HelpScreen))
        await pilot.press("f1")
        await settle(pilot, lambda: isinstance(app.screen, HelpScreen))
        await pilot.click("#close")
        await settle(pilot, lambda: not isinstance(app.screen, HelpScreen))

    run(scenario)


@pytest.mark.parametrize("size", [(80, 24), (120, 40), (200, 60)])
def test_sizes_render_every_panel(size):
    async def scenario(app, pilot, feed):
        await feed_snapshots(pilot, feed, [full_snapshot(uptime=10.0 + i) for i in range(3)])
        text = screen_text(app)
        lines = text.splitlines()
        assert len(lines) == size[1] and all(len(line) <= size[0] for line in lines)
        tall = size[1] >= TALL_ROWS
        for title in TITLES:  # the in-flight list only where it does not squeeze the others
            assert (title in text) == (tall or title != "In flight"), title
        assert "TTFT" in text and "88.2ms" in text and "hit 87.5%" in text
        assert app.query_one("#grid").has_class("wide") == (size[0] >= WIDE_COLUMNS)
        assert app.screen.has_class("compact") == (not tall)
        await pilot.resize_terminal(80, 24)
        await pilot.pause(0.05)
        assert "Engines" in screen_text(app) and "In flight" not in screen_text(app)

    run(scenario, size=size)


@pytest.mark.parametrize("size", [(80, 24), (120, 40)])
def test_l_shows_and_hides_the_requests_in_flight(size):
    async def scenario(app, pilot, feed):
        await feed_snapshots(pilot, feed, [full_snapshot(uptime=10.0 + i) for i in range(2)])
        tall = size[1] >= TALL_ROWS
        assert app.requests_shown() == tall
        await pilot.press("l")
        await pilot.pause(0.05)
        text = screen_text(app)
        assert app.requests_shown() != tall and ("chat-7f3a" in text) != tall
        await pilot.press("l")
        await pilot.pause(0.05)
        assert app.requests_shown() == tall and ("chat-7f3a" in screen_text(app)) == tall
        assert "l Requests" in screen_text(app)  # the key is in the footer

    run(scenario, size=size)


def test_quit_closes_feed_and_admin():
    admin = FakeAdmin()

    async def scenario(app, pilot, feed):
        await pilot.press("q")
        await pilot.pause(0.05)

    app = run(scenario, admin=admin)
    assert admin.closed and app.return_code in (0, None)


def test_console_never_imports_torch_or_numpy():
    code = ("import sys, loraplex.tui.app, loraplex.tui.feed, loraplex.tui.panels; "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'numpy')]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_an_invalid_name_is_refused_in_the_form():
    admin = FakeAdmin()

    async def scenario(app, pilot, feed):
        form = await open_form(app, pilot, "a")
        fill(form, name="my adapter", path="/x")
        await pilot.click("#ok")
        assert app.screen is form and "A-Z a-z 0-9" in str(form.query_one("#form-error").render())
        assert admin.calls == []

    run(scenario, admin=admin)


def test_cli_top_reports_an_unusable_runtime_dir(tmp_path, capsys):
    from loraplex.cli import main

    assert main(["top", "--runtime-dir", str(tmp_path / ("x" * 120))]) == 2
    assert "longer than" in capsys.readouterr().err


def test_many_registered_adapters_show_as_tier_counts_not_repeated_full_lists():
    """At 10,000 registered adapters each full listing costs the daemon's loop: the console shows
    the tier counts from the stats document and fetches the list again only after an action."""
    admin = FakeAdmin()

    async def scenario(app, pilot, feed):
        big = {**base_snapshot(), "adapter_counts": {"total": 10_000, "registered": 9_000, "ready": 998, "error": 2,
                                                     "tiers": {"gpu": 12, "host": 988, "disk": 9_000}}}
        await feed_snapshots(pilot, feed, [big])
        await settle(pilot, lambda: app.view().adapters is not None)  # the first list still comes
        calls = admin.list_calls
        for _ in range(3):
            app._poll_adapters()
            await pilot.pause(0.05)
        assert admin.list_calls == calls
        text = panel(app, "cache")
        assert "gpu 12  host 988" in text  # the whole line: test_tui_panels
        app._poll_adapters(force=True)
        await settle(pilot, lambda: admin.list_calls == calls + 1)

    run(scenario, admin=admin)
