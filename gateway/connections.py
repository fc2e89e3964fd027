"""Client connections: how many may be open at once (max_connections: one more is answered 503
and closed at once) and how long each has to send a request head (header_timeout_s), so
clients that open connections and send their headers slowly, or never, cannot hold the
gateway's sockets. aiohttp bounds the rest itself: head sizes (8190-byte lines and fields, 128
headers) and idle keep-alive connections (keepalive_timeout_s).

A thin asyncio protocol around aiohttp's own, made by the listening site; it passes every byte
through untouched and never reads request data itself.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable

from aiohttp import web

from loraplex.gateway.config import GatewayConfig
from loraplex.gateway.errors import ApiError

log = logging.getLogger("loraplex.gateway")
LOG_EVERY_S = 5.0  # a flood of refused or timed-out connections logs a line this often, not one each


class _Tally:
    """Counts one kind of event; logs the first at once, then a summary at most every LOG_EVERY_S."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.total = 0
        self._unlogged = 0
        self._next_log = 0.0

    def add(self) -> None:
        self.total += 1
        self._unlogged += 1
        now = time.monotonic()
        if now >= self._next_log:
            log.warning("%s: %d connection(s) (%d since the gateway started)", self.what, self._unlogged, self.total)
            self._unlogged = 0
            self._next_log = now + LOG_EVERY_S


class ConnectionGuard:
    """The open connections and their head deadlines; `protocol_factory` wraps aiohttp's."""

    def __init__(self, config: GatewayConfig) -> None:
        self.max_connections = config.max_connections
        self.header_timeout_s = config.header_timeout_s
        self.open = 0
        self.refused = _Tally(f"refused past max_connections = {self.max_connections}")
        self.timed_out = _Tally(f"closed without a whole request head within header_timeout_s = "
                                f"{self.header_timeout_s:g} s")
        self.handlers: dict[object, _Guarded] = {}
        body = json.dumps(ApiError(503, f"the gateway has {self.max_connections} connections open, its limit; "
                                        "try again later", code="too_many_connections").body()).encode()
        self.refusal = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                        b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))

    def protocol_factory(self, make_handler: Callable[[], asyncio.Protocol]) -> Callable[[], asyncio.Protocol]:
        return lambda: _Guarded(self, make_handler)

    def request_started(self, handler: object) -> None:
        """The middleware saw a whole head: no deadline while the request is served."""
        if (guarded := self.handlers.get(handler)) is not None:
            guarded.disarm()

    def request_ended(self, handler: object) -> None:
        """The next request's head gets header_timeout_s from its first byte."""
        if (guarded := self.handlers.get(handler)) is not None:
            guarded.between = True


class _Guarded(asyncio.Protocol):
    """One connection: aiohttp's protocol inside, admitted under the cap, closed when a request
    head is not whole header_timeout_s after the connection opened or the head's first byte came."""

    def __init__(self, guard: ConnectionGuard, make_handler: Callable[[], asyncio.Protocol]) -> None:
        self._guard = guard
        self._make_handler = make_handler
        self._inner: asyncio.Protocol | None = None  # None: refused, or gone
        self._transport: asyncio.Transport | None = None
        self._deadline: asyncio.TimerHandle | None = None
        self.between = False  # a response ended and no byte of the next request came yet

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        guard = self._guard
        if guard.open >= guard.max_connections:
            guard.refused.add()
            transport.write(guard.refusal)  # type: ignore[attr-defined]
            transport.close()
            return
        guard.open += 1
        self._transport = transport  # type: ignore[assignment]
        self._inner = self._make_handler()
        guard.handlers[self._inner] = self
        self._inner.connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        if self._inner is None:
            return
        if self.between:
            self.between = False
            self._arm()
        self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received() if self._inner is not None else None

    def pause_writing(self) -> None:
        if self._inner is not None:
            self._inner.pause_writing()

    def resume_writing(self) -> None:
        if self._inner is not None:
            self._inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        self.disarm()
        inner, self._inner = self._inner, None
        if inner is None:
            return
        self._guard.open -= 1
        self._guard.handlers.pop(inner, None)
        inner.connection_lost(exc)

    def disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _arm(self) -> None:
        self.disarm()
        self._deadline = asyncio.get_running_loop().call_later(self._guard.header_timeout_s, self._expire)

    def _expire(self) -> None:
        self._deadline = None
        if self._transport is not None and self._inner is not None:
            self._guard.timed_out.add()
            self._transport.close()


class GuardedSite(web.TCPSite):
    """aiohttp's TCP site, each connection's protocol wrapped by a ConnectionGuard."""

    def __init__(self, runner: web.BaseRunner, host: str, port: int, guard: ConnectionGuard, *,
                 backlog: int = 128) -> None:
        super().__init__(runner, host, port, backlog=backlog)
        self._guard = guard

    async def start(self) -> None:
        await super(web.TCPSite, self).start()  # BaseSite's: registers the site with its runner
        server = self._runner.server
        if server is None:
            raise RuntimeError("call runner.setup() before starting a site")
        self._server = await asyncio.get_running_loop().create_server(
            self._guard.protocol_factory(server), self._host, self._port, backlog=self._backlog,
            reuse_address=self._reuse_address, reuse_port=self._reuse_port)
        self._bound_port = self._server.sockets[0].getsockname()[1]
