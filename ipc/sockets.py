"""The typed ZMQ socket wrapper every loraplex process uses.

Owns framing and the Message <-> frames step for ROUTER, DEALER, PUB and SUB
sockets, in a blocking flavour (TypedSocket) and an asyncio one
(AsyncTypedSocket), both configured by socket_options.configure (and by curve
for CURVE keys on tcp:// endpoints). Never pickles, never sends raw Python
objects, never blocks forever on a send.

Framing (no empty delimiter frame anywhere, so REQ/REP peers are not
supported):
  DEALER -> ROUTER   [body]             ROUTER receives [identity, body]
  ROUTER -> DEALER   [identity, body]   DEALER receives [body]
  PUB    -> SUB      [body]             SUB subscribes to everything
Receiving a frame that does not decode raises ProtocolError with `.identity`
set to the sending peer (on a ROUTER), so the caller answers that client with
ErrorReply.from_error(err) and keeps serving the others. A send the peer
cannot take (gone, or its queue is full) raises PeerUnavailable.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple, overload

import zmq
import zmq.asyncio

from loraplex.ipc.codec import decode, encode
from loraplex.ipc.curve import CurveKeys
from loraplex.ipc.errors import ErrorCode, ProtocolError
from loraplex.ipc.protocol import Message
from loraplex.ipc.socket_options import (
    DEFAULT_SOCKET_LIMITS,
    SocketKind,
    SocketLimits,
    configure,
    finish_ipc_bind,
    prepare_ipc_bind,
    remove_ipc_file,
)


class Envelope(NamedTuple):
    """One received message; `identity` is the sending peer on a ROUTER, else None."""

    identity: bytes | None
    message: Message


class PeerUnavailable(Exception):
    """A send could not be queued: the peer is gone or not keeping up.

    The message was not sent. On a ROUTER the caller should treat the client
    `identity` as disconnected (cancel its requests); on a DEALER it means the
    queue to the server stayed full for send_timeout_ms.
    """

    def __init__(self, identity: bytes | None, reason: str) -> None:
        super().__init__(reason)
        self.identity = identity
        self.reason = reason


def _outgoing(kind: SocketKind, data: bytes, identity: bytes | None) -> list[bytes]:
    if kind is SocketKind.SUB:
        raise TypeError("a SUB socket cannot send")
    if kind is SocketKind.ROUTER:
        if not isinstance(identity, bytes) or not identity:
            raise ValueError("a ROUTER send needs the peer identity (bytes from recv())")
        return [identity, data]
    if identity is not None:
        raise ValueError(f"a {kind.value.upper()} socket has no peer identity to send to")
    return [data]


def _incoming(kind: SocketKind, frames: list[bytes], limits: SocketLimits) -> Envelope:
    if kind is SocketKind.ROUTER:
        identity = frames[0]
        if len(frames) != 2:
            raise ProtocolError(
                ErrorCode.BAD_MESSAGE,
                f"expected one body frame after the identity, got {len(frames) - 1} (no empty delimiter)",
                identity=identity,
            )
        try:
            return Envelope(identity, decode(frames[1], limits.decode))
        except ProtocolError as exc:
            raise exc.with_context(identity=identity) from None
    if len(frames) != 1:
        raise ProtocolError(ErrorCode.BAD_MESSAGE, f"expected one frame, got {len(frames)}")
    return Envelope(None, decode(frames[0], limits.decode))


def _send_failure(kind: SocketKind, identity: bytes | None, exc: zmq.ZMQError, limits: SocketLimits) -> Exception:
    if isinstance(exc, zmq.Again):
        if kind is SocketKind.ROUTER:
            return PeerUnavailable(identity, f"queue to peer full ({limits.sndhwm} messages)")
        return PeerUnavailable(identity, f"queue full for {limits.send_timeout_ms} ms")
    if exc.errno == zmq.EHOSTUNREACH:
        return PeerUnavailable(identity, "peer disconnected")
    return exc


def _send_flags(kind: SocketKind) -> int:
    # ROUTER (one slow client must not stall the daemon) and PUB never wait;
    # a DEALER waits up to SNDTIMEO.
    return zmq.DONTWAIT if kind in (SocketKind.ROUTER, SocketKind.PUB) else 0


class _Base:
    """What both flavours share: kind, limits, endpoint, lifecycle."""

    def __init__(
        self, sock: Any, kind: SocketKind, endpoint: str, *, bind: bool, limits: SocketLimits,
        curve: CurveKeys | None = None, monitor_events: int = 0,
    ) -> None:
        self._sock = sock
        self._monitor: Any = None
        self.kind = kind
        self.endpoint = endpoint
        self.limits = limits
        self._bound_path: Path | None = None
        self._bound_file: tuple[int, int] | None = None
        try:
            configure(sock, kind, limits)
            if curve is not None:
                curve.apply(sock, endpoint)
            if monitor_events:  # before connecting, so that no event of the first connection is missed
                self._monitor = sock.get_monitor_socket(monitor_events)
            if bind:
                self._bound_path = prepare_ipc_bind(endpoint)
                sock.bind(endpoint)
                self._bound_file = finish_ipc_bind(self._bound_path)
            else:
                sock.connect(endpoint)
        except BaseException:
            self._close_monitor()
            sock.close(linger=0)
            raise

    @property
    def socket(self) -> Any:
        """The underlying zmq socket, for pollers; do not send or recv on it."""
        return self._sock

    @property
    def monitor(self) -> Any:
        """The PAIR socket receiving this socket's `monitor_events` (None without), for pollers."""
        return self._monitor

    @property
    def closed(self) -> bool:
        return bool(self._sock.closed)

    def _close_monitor(self) -> None:
        if self._monitor is not None and not self._monitor.closed:
            self._sock.disable_monitor()
            self._monitor.close(linger=0)

    def close(self) -> None:
        if self._sock.closed:
            return
        self._close_monitor()
        self._sock.close()
        remove_ipc_file(self._bound_path, self._bound_file)

    def _check_can_recv(self) -> None:
        if self.kind is SocketKind.PUB:
            raise TypeError("a PUB socket cannot receive")


class TypedSocket(_Base):
    """Blocking flavour, for the engine's control loop and CPU workers."""

    def __enter__(self) -> TypedSocket:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def send(self, msg: Message, identity: bytes | None = None) -> None:
        """Encode and queue `msg`; `identity` is required on a ROUTER, forbidden elsewhere."""
        frames = _outgoing(self.kind, encode(msg, self.limits.decode), identity)
        try:
            self._sock.send_multipart(frames, flags=_send_flags(self.kind))
        except zmq.ZMQError as exc:
            raise _send_failure(self.kind, identity, exc, self.limits) from None

    def poll(self, timeout_ms: int = 0) -> bool:
        """Whether a message is waiting (after up to `timeout_ms`)."""
        return bool(self._sock.poll(timeout_ms, zmq.POLLIN))

    def recv(self, timeout_ms: int | None = None) -> Envelope:
        """The next message. Raises TimeoutError after `timeout_ms` (None waits
        forever) and ProtocolError (with .identity) for undecodable input."""
        self._check_can_recv()
        if timeout_ms is not None and not self._sock.poll(timeout_ms, zmq.POLLIN):
            raise TimeoutError(f"no message on {self.endpoint} within {timeout_ms} ms")
        return _incoming(self.kind, self._sock.recv_multipart(), self.limits)


class AsyncTypedSocket(_Base):
    """asyncio flavour (zmq.asyncio; works under uvloop), for the daemon."""

    async def __aenter__(self) -> AsyncTypedSocket:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()

    async def send(self, msg: Message, identity: bytes | None = None) -> None:
        """As TypedSocket.send; a DEALER send waits without blocking the loop."""
        frames = _outgoing(self.kind, encode(msg, self.limits.decode), identity)
        try:
            await self._sock.send_multipart(frames, flags=_send_flags(self.kind))
        except zmq.ZMQError as exc:
            raise _send_failure(self.kind, identity, exc, self.limits) from None

    async def poll(self, timeout_ms: int = 0) -> bool:
        return bool(await self._sock.poll(timeout_ms, zmq.POLLIN))

    async def recv(self, timeout_ms: int | None = None) -> Envelope:
        """As TypedSocket.recv. Prefer `timeout_ms` to cancelling the task:
        the timeout fires before a message is taken off the socket, whereas a
        cancellation racing an arriving message can lose that message."""
        self._check_can_recv()
        if timeout_ms is not None and not await self._sock.poll(timeout_ms, zmq.POLLIN):
            raise TimeoutError(f"no message on {self.endpoint} within {timeout_ms} ms")
        return _incoming(self.kind, await self._sock.recv_multipart(), self.limits)


@overload
def open_socket(
    ctx: zmq.asyncio.Context, kind: SocketKind, endpoint: str, *, bind: bool, limits: SocketLimits = ...,
    curve: CurveKeys | None = ..., monitor_events: int = ...
) -> AsyncTypedSocket: ...
@overload
def open_socket(
    ctx: zmq.Context[Any], kind: SocketKind, endpoint: str, *, bind: bool, limits: SocketLimits = ...,
    curve: CurveKeys | None = ..., monitor_events: int = ...
) -> TypedSocket: ...
def open_socket(
    ctx: Any, kind: SocketKind, endpoint: str, *, bind: bool, limits: SocketLimits = DEFAULT_SOCKET_LIMITS,
    curve: CurveKeys | None = None, monitor_events: int = 0,
) -> TypedSocket | AsyncTypedSocket:
    """A configured, bound or connected socket; asyncio flavour for a
    zmq.asyncio.Context, blocking flavour for a plain zmq.Context. `curve`
    (tcp:// only) makes it a CURVE server or client with those keys;
    `monitor_events` (zmq.EVENT_* bits) attaches `.monitor` before connecting."""
    if not isinstance(limits, SocketLimits):
        raise TypeError(f"limits must be SocketLimits, got {type(limits).__name__}")
    cls = AsyncTypedSocket if isinstance(ctx, zmq.asyncio.Context) else TypedSocket
    return cls(ctx.socket(kind.zmq_type), kind, endpoint, bind=bind, limits=limits, curve=curve,
               monitor_events=monitor_events)


@overload
def make_router(ctx: zmq.asyncio.Context, endpoint: str, *, bind: bool = ..., limits: SocketLimits = ...,
                curve: CurveKeys | None = ...) -> AsyncTypedSocket: ...
@overload
def make_router(ctx: zmq.Context[Any], endpoint: str, *, bind: bool = ..., limits: SocketLimits = ...,
                curve: CurveKeys | None = ...) -> TypedSocket: ...
def make_router(ctx: Any, endpoint: str, *, bind: bool = True, limits: SocketLimits = DEFAULT_SOCKET_LIMITS,
                curve: CurveKeys | None = None) -> Any:
    """Server side of request/reply: binds by default."""
    return open_socket(ctx, SocketKind.ROUTER, endpoint, bind=bind, limits=limits, curve=curve)


@overload
def make_dealer(ctx: zmq.asyncio.Context, endpoint: str, *, bind: bool = ..., limits: SocketLimits = ...,
                curve: CurveKeys | None = ..., monitor_events: int = ...) -> AsyncTypedSocket: ...
@overload
def make_dealer(ctx: zmq.Context[Any], endpoint: str, *, bind: bool = ..., limits: SocketLimits = ...,
                curve: CurveKeys | None = ..., monitor_events: int = ...) -> TypedSocket: ...
def make_dealer(ctx: Any, endpoint: str, *, bind: bool = False, limits: SocketLimits = DEFAULT_SOCKET_LIMITS,
                curve: CurveKeys | None = None, monitor_events: int = 0) -> Any:
    """Client side of request/reply: connects by default."""
    return open_socket(ctx, SocketKind.DEALER, endpoint, bind=bind, limits=limits, curve=curve,
                       monitor_events=monitor_events)


@overload
def make_pub(ctx: zmq.asyncio.Context, endpoint: str, *, bind: bool = ...,
             limits: SocketLimits = ...) -> AsyncTypedSocket: ...
@overload
def make_pub(ctx: zmq.Context[Any], endpoint: str, *, bind: bool = ..., limits: SocketLimits = ...) -> TypedSocket: ...
def make_pub(ctx: Any, endpoint: str, *, bind: bool = True, limits: SocketLimits = DEFAULT_SOCKET_LIMITS) -> Any:
    """Publisher (the stats stream): binds by default; drops for slow subscribers."""
    return open_socket(ctx, SocketKind.PUB, endpoint, bind=bind, limits=limits)


@overload
def make_sub(ctx: zmq.asyncio.Context, endpoint: str, *, bind: bool = ...,
             limits: SocketLimits = ...) -> AsyncTypedSocket: ...
@overload
def make_sub(ctx: zmq.Context[Any], endpoint: str, *, bind: bool = ..., limits: SocketLimits = ...) -> TypedSocket: ...
def make_sub(ctx: Any, endpoint: str, *, bind: bool = False, limits: SocketLimits = DEFAULT_SOCKET_LIMITS) -> Any:
    """Subscriber to everything a PUB sends: connects by default."""
    return open_socket(ctx, SocketKind.SUB, endpoint, bind=bind, limits=limits)
