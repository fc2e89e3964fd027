"""Where the console's snapshots come from: the daemon's stats PUB stream, or a queue.

Owns the subscription and its reconnect policy. A feed is an async iterator
of events (Snapshot, or Disconnected when the stream went quiet); it never
raises for a missing or restarting daemon and never blocks its event loop:
every receive is an awaited poll with a timeout. Torch-, numpy- and Textual-free.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, Union

import zmq
import zmq.asyncio

from loraplex.ipc.errors import ProtocolError
from loraplex.ipc.protocol import StatsReply
from loraplex.ipc.socket_options import ipc_path
from loraplex.ipc.sockets import AsyncTypedSocket, make_sub

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Snapshot:
    """One stats snapshot; `received` is the local monotonic receive time."""

    stats: Mapping[str, Any]
    received: float


@dataclass(frozen=True, slots=True)
class Disconnected:
    """No snapshot for a while (daemon gone, restarting, or never there)."""

    reason: str


FeedEvent = Union[Snapshot, Disconnected]


class Feed(Protocol):
    """What the console reads. events() may be iterated once; close() ends it."""

    def events(self) -> AsyncIterator[FeedEvent]: ...

    async def close(self) -> None: ...


class StatsFeed:
    """Subscribes to the daemon's stats PUB at `endpoint`.

    Yields a Snapshot per message, skipping to the newest when several are
    queued (the console shows the present, not a backlog). After
    `stale_after_s` without one it yields Disconnected once and reopens the
    SUB socket (so a daemon that restarted and re-created its socket file is
    found again), repeating every `stale_after_s` until snapshots resume.
    """

    def __init__(self, endpoint: str, *, stale_after_s: float = 2.5, poll_ms: int = 200,
                 context: zmq.asyncio.Context | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        if not stale_after_s > 0 or poll_ms <= 0:
            raise ValueError("stale_after_s and poll_ms must be positive")
        self.endpoint = endpoint
        self.stale_after_s = stale_after_s
        self.poll_ms = poll_ms
        self._context = context
        self._clock = clock
        self._sock: AsyncTypedSocket | None = None
        self._closed = False

    def _open(self) -> AsyncTypedSocket:
        ctx = self._context if self._context is not None else zmq.asyncio.Context.instance()
        self._sock = make_sub(ctx, self.endpoint)
        return self._sock

    def _drop(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def quiet_reason(self) -> str:
        path = ipc_path(self.endpoint)
        if path is not None and not path.exists():
            return f"no daemon: {path} does not exist"
        return f"no stats from {self.endpoint} for {self.stale_after_s:g} s"

    async def _newest(self, sock: AsyncTypedSocket) -> StatsReply | None:
        """The newest stats message among those already queued (one wait of poll_ms)."""
        newest: StatsReply | None = None
        timeout = self.poll_ms
        while True:
            try:
                message = (await sock.recv(timeout_ms=timeout)).message
            except TimeoutError:
                return newest
            except ProtocolError as exc:
                log.warning("dropping an undecodable stats message: %s", exc)
                timeout = 0
                continue
            timeout = 0
            if isinstance(message, StatsReply):
                newest = message

    async def events(self) -> AsyncIterator[FeedEvent]:
        heard_at = self._clock()  # last snapshot, or when we (re)opened the socket
        reported = False
        try:
            while not self._closed:
                sock = self._sock or self._open()
                try:
                    message = await self._newest(sock)
                except zmq.ZMQError as exc:
                    if self._closed:
                        return
                    log.warning("stats socket failed (%s); reopening", exc)
                    message = None
                    self._drop()
                now = self._clock()
                if message is not None:
                    heard_at, reported = now, False
                    yield Snapshot(dict(message.stats), now)
                elif now - heard_at >= self.stale_after_s:
                    if not reported:
                        reported = True
                        yield Disconnected(self.quiet_reason())
                    self._drop()
                    heard_at = now
        finally:
            self._drop()

    async def close(self) -> None:
        self._closed = True


class QueueFeed:
    """A feed whose events its owner puts in: tests, replays, demos."""

    def __init__(self) -> None:
        self._queue: asyncio.Queue[FeedEvent | None] = asyncio.Queue()

    @property
    def pending(self) -> int:
        """Events put but not yet taken by the reader."""
        return self._queue.qsize()

    def put(self, event: FeedEvent) -> None:
        self._queue.put_nowait(event)

    def snapshot(self, stats: Mapping[str, Any], received: float | None = None) -> None:
        self.put(Snapshot(dict(stats), time.monotonic() if received is None else received))

    def disconnect(self, reason: str = "daemon stopped") -> None:
        self.put(Disconnected(reason))

    async def events(self) -> AsyncIterator[FeedEvent]:
        while (event := await self._queue.get()) is not None:
            yield event

    async def close(self) -> None:
        self._queue.put_nowait(None)
