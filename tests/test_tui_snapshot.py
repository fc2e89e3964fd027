"""Golden text snapshots of the console's main screen at 80x24, with every
stats key present and with only today's keys. Regenerate after an intended
change with LORAPLEX_UPDATE_SNAPSHOTS=1 and review the diff of tests/snapshots/.
"""
from __future__ import annotations

import asyncio
import difflib
import os
import time
from pathlib import Path

import pytest

from loraplex.tui.app import LoraplexTop
from loraplex.tui.feed import QueueFeed
from tests.test_tui_support import FakeAdmin, base_snapshot, full_snapshot, screen_text

SNAPSHOTS = Path(__file__).parent / "snapshots"
UPDATE = os.environ.get("LORAPLEX_UPDATE_SNAPSHOTS") == "1"


@pytest.fixture
def utc(monkeypatch):
    """Error timestamps render in local time: pin the zone."""
    monkeypatch.setenv("TZ", "UTC")
    time.tzset()
    yield
    monkeypatch.undo()
    time.tzset()


def normalise(text: str) -> str:
    return "\n".join(line.rstrip() for line in text.splitlines()) + "\n"


def render_screen(make, size=(80, 24)) -> str:
    """The main screen after six snapshots one second apart (fixed clock, so no ages move)."""
    feed = QueueFeed()
    app = LoraplexTop(feed, FakeAdmin(adapters=[]), target="/run/lpx", clock=lambda: 1000.0,
                      adapters_poll_s=60.0)
    out: list[str] = []

    async def main() -> None:
        async with app.run_test(size=size) as pilot:
            for i in range(6):
                s = make(uptime=3600.0 + i, tokens=10_000 + 750 * i, evictions=10 + i, requests=500 + 2 * i)
                if "pcie" in s:
                    s["pcie"]["h2d_mb_s"] = 200.0 * (i + 1)
                feed.snapshot(s, received=1000.0)
            # Until every snapshot is applied and the footer has laid out its keys (it does so after mount).
            deadline = asyncio.get_running_loop().time() + 5.0
            while (feed.pending or "Quit" not in screen_text(app)) and asyncio.get_running_loop().time() < deadline:
                await pilot.pause(0.02)
            await pilot.pause()
            out.append(screen_text(app))

    asyncio.run(main())
    return normalise(out[0])


@pytest.mark.parametrize("name, make", [("top_80x24_full", full_snapshot), ("top_80x24_today", base_snapshot)])
def test_main_screen_matches_golden(name, make, utc):
    text = render_screen(make)
    golden = SNAPSHOTS / f"{name}.txt"
    if UPDATE:
        golden.parent.mkdir(parents=True, exist_ok=True)
        golden.write_text(text, encoding="utf-8")
    assert golden.exists(), f"{golden} is missing; create it with LORAPLEX_UPDATE_SNAPSHOTS=1"
    expected = golden.read_text(encoding="utf-8")
    diff = "".join(difflib.unified_diff(expected.splitlines(True), text.splitlines(True), "golden", "now"))
    assert text == expected, f"screen differs from {golden.name} (LORAPLEX_UPDATE_SNAPSHOTS=1 to accept):\n{diff}"
