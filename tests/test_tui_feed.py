"""The console's stats feed against a real PUB socket: snapshots arrive, a
silent or vanished publisher is reported once, and a publisher that comes
back on the same path (a restarted daemon) is found again."""
from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path

import pytest
import zmq
import zmq.asyncio

from loraplex.ipc.protocol import StatsReply
from loraplex.ipc.runtime_dir import endpoints
from loraplex.ipc.sockets import make_pub
from loraplex.tui.feed import Disconnected, QueueFeed, Snapshot, StatsFeed


class Publisher:
    """A stand-in daemon: publishes {'n': i} every 20 ms until stopped."""

    def __init__(self, ctx: zmq.asyncio.Context, endpoint: str) -> None:
        self.sock = make_pub(ctx, endpoint)
        self.task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        n = 0
        while True:
            await self.sock.send(StatsReply(stats={"n": n, "uptime_s": float(n)}))
            n += 1
            await asyncio.sleep(0.02)

    async def stop(self) -> None:
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)
        self.sock.close()


async def next_event(events, kind, timeout: float = 5.0):
    async def find():
        async for event in events:
            if isinstance(event, kind):
                return event
    return await asyncio.wait_for(find(), timeout)


def test_stats_feed_reports_disconnect_and_reconnects_after_restart():
    async def scenario() -> None:
        with tempfile.TemporaryDirectory(prefix="lpx-tui-") as tmp:
            ctx = zmq.asyncio.Context()
            endpoint = endpoints(tmp).stats
            feed = StatsFeed(endpoint, stale_after_s=0.4, poll_ms=50, context=ctx)
            events = feed.events()
            try:
                first = await next_event(events, Disconnected)  # nothing there yet
                assert "does not exist" in first.reason and "stats.sock" in first.reason
                publisher = Publisher(ctx, endpoint)
                snap = await next_event(events, Snapshot)
                assert "n" in snap.stats and snap.received > 0
                await publisher.stop()  # the daemon goes away (socket file removed)
                gone = await next_event(events, Disconnected)
                assert "does not exist" in gone.reason
                publisher = Publisher(ctx, endpoint)  # ...and comes back at the same path
                again = await next_event(events, Snapshot)
                assert again.stats["n"] < 50  # from the new publisher, which started counting afresh
                await publisher.stop()
            finally:
                await feed.close()
                await events.aclose()
                ctx.term()
            assert not Path(tmp, "stats.sock").exists()

    asyncio.run(scenario())


def test_stats_feed_skips_to_the_newest_queued_snapshot():
    async def scenario() -> None:
        with tempfile.TemporaryDirectory(prefix="lpx-tui-") as tmp:
            ctx = zmq.asyncio.Context()
            endpoint = endpoints(tmp).stats
            pub = make_pub(ctx, endpoint)
            feed = StatsFeed(endpoint, stale_after_s=5.0, poll_ms=50, context=ctx)
            events = feed.events()
            try:
                # Publish until the subscription is live, then a burst the console has not read yet.
                waiter = asyncio.ensure_future(next_event(events, Snapshot))
                while not waiter.done():
                    await pub.send(StatsReply(stats={"n": -1}))
                    await asyncio.sleep(0.02)
                for n in range(20):
                    await pub.send(StatsReply(stats={"n": n}))
                await asyncio.sleep(0.1)
                snap = await next_event(events, Snapshot)
                assert snap.stats["n"] == 19
            finally:
                await feed.close()
                await events.aclose()
                pub.close()
                ctx.term()

    asyncio.run(scenario())


def test_stats_feed_rejects_bad_settings():
    with pytest.raises(ValueError):
        StatsFeed("ipc:///tmp/x.sock", stale_after_s=0)


def test_queue_feed_yields_what_was_put_until_closed():
    async def scenario() -> list:
        feed = QueueFeed()
        feed.snapshot({"a": 1}, received=3.0)
        feed.disconnect("gone")
        await feed.close()
        return [event async for event in feed.events()]

    assert asyncio.run(scenario()) == [Snapshot({"a": 1}, 3.0), Disconnected("gone")]
