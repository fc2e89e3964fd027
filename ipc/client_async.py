"""asyncio client library: AsyncClient and AsyncAdminClient, for servers,
gateways and load generators (works under uvloop).

Any number of concurrent requests share ONE DEALER socket per client: a single
reader task demultiplexes replies by request id into per-request queues. A
client is bound to the event loop it is first used in and is not
thread-safe (use it from that loop's thread; the sync Client is for threads).
"""
from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import TYPE_CHECKING, Any, Sequence, TypeVar

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from loraplex.ipc import client_calls as calls
from loraplex.ipc.client_calls import (
    ADD_ADAPTER_TIMEOUT_S,
    CONTROL_TIMEOUT_S,
    Call,
    GenerateOptions,
    Item,
    R,
    StreamAssembler,
    generate_request,
)
from loraplex.ipc.client_core import (
    CLIENT_SOCKET_LIMITS,
    MONITOR_EVENTS,
    ClientCore,
    resolve_endpoint,
    send_failed,
    timed_out,
)
from loraplex.ipc.client_types import AdapterInfo, GenerateResult, Liveness, StreamChunk, Tokenized
from loraplex.ipc.curve import CurveClientKeys, check_tcp_endpoint
from loraplex.ipc.errors import ErrorCode, LoraplexError, ProtocolError
from loraplex.ipc.protocol import CancelRequest, GenerateRequest, Message, PolicyKind
from loraplex.ipc.socket_options import SocketLimits
from loraplex.ipc.sockets import AsyncTypedSocket, PeerUnavailable, make_dealer

if TYPE_CHECKING:  # typing.Unpack is Python 3.11+; annotations are not evaluated (3.10 supported)
    from typing import Unpack

log = logging.getLogger(__name__)
_B = TypeVar("_B", bound="_AsyncBase")


class _AsyncTransport:
    """One DEALER, one reader task, a connection monitor and a liveness watchdog.

    Opened lazily inside the event loop of the first call.
    """

    def __init__(
        self, endpoint: str, limits: SocketLimits, liveness: Liveness | None, context: zmq.asyncio.Context | None,
        curve: CurveClientKeys | None = None,
    ) -> None:
        self.endpoint = endpoint
        self._limits = limits
        if curve is not None:
            check_tcp_endpoint(endpoint)  # now, not at the first call
        self._curve = curve
        self._liveness = liveness
        self._context = context
        self._core = ClientCore(endpoint, liveness, curve is not None, time.monotonic())
        self._loop: asyncio.AbstractEventLoop | None = None
        self._sock: AsyncTypedSocket | None = None
        self._monitor: Any = None
        self._wake = asyncio.Event()
        self._link_changed = asyncio.Event()  # set by each monitor event (handshake waits)
        self._tasks: list[asyncio.Task[None]] = []
        self._background: set[asyncio.Task[None]] = set()
        self._closed = False

    def _open(self) -> AsyncTypedSocket:
        loop = asyncio.get_running_loop()
        if self._closed:
            raise LoraplexError(ErrorCode.UNAVAILABLE, "the client is closed")
        if self._sock is None:
            ctx = self._context if self._context is not None else zmq.asyncio.Context.instance()
            self._sock = make_dealer(ctx, self.endpoint, limits=self._limits, curve=self._curve,
                                     monitor_events=MONITOR_EVENTS)
            self._monitor = self._sock.monitor
            self._loop = loop
            self._tasks = [
                loop.create_task(self._read(self._sock)),
                loop.create_task(self._watch_connection(self._monitor)),
            ]
            if self._liveness is not None:
                self._tasks.append(loop.create_task(self._watch_liveness()))
        elif loop is not self._loop:
            raise RuntimeError("an AsyncClient is bound to the event loop it was first used in")
        return self._sock

    async def start(self, msg: Message, request_id: str, cancellable: bool) -> asyncio.Queue[Item]:
        """Register `request_id` and send `msg`; its replies arrive on the returned queue."""
        self._open()
        replies: asyncio.Queue[Item] = asyncio.Queue()
        if self._core.begin(request_id, replies.put_nowait, cancellable, time.monotonic()):
            self._wake.set()
        try:
            await self.send(msg)
        except BaseException:
            if cancellable:
                self.abandon(request_id)
            else:
                self._core.table.discard(request_id)
            raise
        return replies

    async def _await_handshake(self) -> None:
        """tcp: until the first handshake, watch the monitor instead of blocking in send, so a
        refused handshake (CURVE) fails the request at once rather than after SNDTIMEO."""
        link = self._core.link
        deadline = time.monotonic() + self._limits.send_timeout_ms / 1e3
        while not link.handshaken and link.refused is None:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            self._link_changed.clear()
            try:
                await asyncio.wait_for(self._link_changed.wait(), left)
            except asyncio.TimeoutError:
                return

    async def send(self, msg: Message) -> None:
        link = self._core.link
        sock = self._open()
        if self.endpoint.startswith("tcp://") and not link.handshaken:
            await self._await_handshake()
        if link.refused is not None:  # no connection to send on: it would only wait for SNDTIMEO
            raise LoraplexError(ErrorCode.UNAVAILABLE, link.refused, getattr(msg, "request_id", None))
        try:
            await sock.send(msg)
        except (PeerUnavailable, ProtocolError) as exc:
            if link.refused is not None:  # the handshake failed while the send waited: say why
                raise LoraplexError(ErrorCode.UNAVAILABLE, link.refused, getattr(msg, "request_id", None)) from None
            raise send_failed(self.endpoint, exc, getattr(msg, "request_id", None)) from None

    async def send_quietly(self, *messages: Message) -> None:
        """Best effort, also while closing (cancels, probes)."""
        for msg in messages:
            if self._sock is None or self._core.link.refused is not None:
                return
            try:
                await self._sock.send(msg)
            except (PeerUnavailable, ProtocolError) as exc:
                log.debug("could not send %s: %s", msg.TYPE, exc)

    def forget(self, request_id: str) -> bool:
        return self._core.table.discard(request_id)

    def abandon(self, request_id: str) -> None:
        """Stop waiting for `request_id`; cancel it on the daemon if it was in
        flight. Callable from sync code and finalizers, in any thread."""
        loop = self._loop
        if not self._core.table.discard(request_id) or loop is None or loop.is_closed():
            return
        msg = CancelRequest(request_id=request_id)
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            self._spawn_send(msg)  # now, so that a close() right after still sends it
            return
        try:
            loop.call_soon_threadsafe(self._spawn_send, msg)
        except RuntimeError:
            pass  # the loop closed in between

    def _spawn_send(self, msg: Message) -> None:
        if self._sock is None or self._loop is None:
            return
        task = self._loop.create_task(self.send_quietly(msg))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    @staticmethod
    async def wait(replies: asyncio.Queue[Item], deadline: float | None) -> Item:
        """The next reply; asyncio.TimeoutError once `deadline` (monotonic) passes."""
        if not replies.empty():
            return replies.get_nowait()
        if deadline is None:
            return await replies.get()
        return await asyncio.wait_for(replies.get(), max(0.0, deadline - time.monotonic()))

    async def _read(self, sock: AsyncTypedSocket) -> None:
        try:
            while True:
                try:
                    _, msg = await sock.recv()
                except ProtocolError as exc:
                    self._core.undecodable(exc, time.monotonic())
                    continue
                self._core.received(msg, time.monotonic())
        except Exception as exc:
            log.exception("loraplex client reader failed")
            self._closed = True
            self._core.table.fail_all(ErrorCode.INTERNAL, f"the client's reader failed: {exc!r}")

    async def _watch_connection(self, monitor: zmq.asyncio.Socket) -> None:
        while True:
            message = parse_monitor_message(await monitor.recv_multipart())
            messages = self._core.connection_event(message["event"], message["value"])
            self._link_changed.set()
            await self.send_quietly(*messages)

    async def _watch_liveness(self) -> None:
        while True:
            self._wake.clear()
            messages, wait_s = self._core.check_liveness(time.monotonic())
            await self.send_quietly(*messages)
            try:
                await asyncio.wait_for(self._wake.wait(), wait_s)
            except asyncio.TimeoutError:
                pass

    async def close(self) -> None:
        if self._closed and self._sock is None:
            return
        self._closed = True
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        sock = self._sock
        if sock is None:
            self._core.table.fail_all(ErrorCode.UNAVAILABLE, "the client was closed")
            return
        try:
            sock.socket.setsockopt(zmq.SNDTIMEO, 0)  # closing must not wait on a full queue
            await asyncio.gather(*self._background, return_exceptions=True)
            await self.send_quietly(*self._core.fail_in_flight("the client was closed"))
        finally:
            self._sock = None
            self._monitor = None
            sock.close()  # and its monitor


class AsyncStream:
    """Async iterator over the chunks of one streamed generate.

    The request is sent when iteration starts (or on `async with`). End
    convention: once `async for` ends normally, `.result` holds the
    GenerateResult (None before). Leaving early cancels the request on the
    daemon: aclose(), an `async with` block, or dropping the iterator.
    """

    def __init__(self, client: _AsyncBase, request: GenerateRequest, timeout: float | None) -> None:
        self._client = client  # keeps the client alive while we iterate
        self._transport = client._transport
        self._request = request
        self.request_id = request.request_id
        self._timeout = timeout
        self._deadline: float | None = None
        self._assembler = StreamAssembler(request)
        self._replies: asyncio.Queue[Item] | None = None
        self._finished = False

    @property
    def result(self) -> GenerateResult | None:
        return self._assembler.result

    def finished_result(self) -> GenerateResult:
        return self._assembler.finished_result()

    async def _start(self) -> asyncio.Queue[Item]:
        if self._replies is None:
            if self._finished:
                raise LoraplexError(ErrorCode.CANCELLED, "the stream was closed before it started", self.request_id)
            self._replies = await self._transport.start(self._request, self.request_id, cancellable=True)
            self._deadline = None if self._timeout is None else time.monotonic() + self._timeout
        return self._replies

    def __aiter__(self) -> AsyncStream:
        return self

    async def __anext__(self) -> StreamChunk:
        if self._finished:
            raise StopAsyncIteration
        try:
            item = await self._transport.wait(await self._start(), self._deadline)
        except asyncio.TimeoutError:
            self._abandon()
            raise timed_out(self.request_id, self._timeout) from None
        except BaseException:
            self._abandon()
            raise
        try:
            chunk = self._assembler.feed(item)
        except LoraplexError:
            self._finished = True
            raise
        if chunk is None:
            self._finished = True
            raise StopAsyncIteration
        return chunk

    def _abandon(self) -> None:
        self._finished = True
        if self._replies is not None:
            self._transport.abandon(self.request_id)

    async def aclose(self) -> None:
        """Stop reading; cancels the request if the daemon has not finished it."""
        was_open, self._finished = not self._finished, True
        if was_open and self._replies is not None and self._transport.forget(self.request_id):
            await self._transport.send_quietly(CancelRequest(request_id=self.request_id))

    async def __aenter__(self) -> AsyncStream:
        await self._start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def __del__(self) -> None:
        if not getattr(self, "_finished", True) and self._replies is not None:
            self._abandon()


class _AsyncBase:
    """Construction, lifecycle and the calls both sockets answer (adapters, stats, ping)."""

    _SOCKET = "client"  # which of the runtime directory's sockets is the default

    def __init__(
        self,
        endpoint: str | None = None,
        *,
        runtime_dir: str | os.PathLike[str] | None = None,
        liveness: Liveness | None = Liveness(),
        limits: SocketLimits = CLIENT_SOCKET_LIMITS,
        context: zmq.asyncio.Context | None = None,
        curve: CurveClientKeys | None = None,
    ) -> None:
        self.endpoint = resolve_endpoint(endpoint, runtime_dir, self._SOCKET)
        self._transport = _AsyncTransport(self.endpoint, limits, liveness, context, curve)

    async def close(self) -> None:
        """Fail and cancel whatever is in flight, then close the socket. Idempotent."""
        await self._transport.close()

    async def __aenter__(self: _B) -> _B:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _call(self, call: Call[R]) -> R:
        """Send `call`'s request and wait for its reply (at most its timeout)."""
        replies = await self._transport.start(call.request, call.request_id, cancellable=False)
        deadline = None if call.timeout is None else time.monotonic() + call.timeout
        try:
            item = await self._transport.wait(replies, deadline)
        except asyncio.TimeoutError:
            raise timed_out(call.request_id, call.timeout) from None
        finally:
            self._transport.forget(call.request_id)
        return call.finish(item)

    async def adapters(self, *, timeout: float | None = CONTROL_TIMEOUT_S) -> list[AdapterInfo]:
        """The registered adapters."""
        return await self._call(calls.list_adapters(timeout))

    async def tokenize(self, text: str, *, timeout: float | None = CONTROL_TIMEOUT_S) -> Tokenized:
        """`text`'s token ids under the daemon's tokenizer (as a prompt gets them), and the context length."""
        return await self._call(calls.tokenize(text, timeout))

    async def detokenize(self, token_ids: Sequence[int], *, timeout: float | None = CONTROL_TIMEOUT_S) -> str:
        """The text of `token_ids` (special tokens kept)."""
        return await self._call(calls.detokenize(token_ids, timeout))

    async def stats(self, *, timeout: float | None = CONTROL_TIMEOUT_S) -> dict[str, object]:
        """One snapshot of the daemon's metrics."""
        return await self._call(calls.stats(timeout))

    async def ping(self, *, timeout: float | None = CONTROL_TIMEOUT_S) -> float:
        """Round-trip time to the daemon in seconds."""
        return await self._call(calls.ping(timeout))


class AsyncClient(_AsyncBase):
    """asyncio client of the daemon's client socket; arguments (curve included) as for
    Client (context: a zmq.asyncio.Context to share, default the process-wide one)."""

    async def generate(
        self,
        prompt: str | Sequence[int],
        adapter: str | None = None,
        **options: Unpack[GenerateOptions],
    ) -> GenerateResult:
        """As Client.generate. Cancelling the awaiting task cancels the request."""
        request = generate_request(prompt, adapter=adapter, stream=False, **options)
        timeout = options.get("timeout")
        stream = AsyncStream(self, request, timeout)
        async for _ in stream:
            pass
        return stream.finished_result()

    def stream(
        self,
        prompt: str | Sequence[int],
        adapter: str | None = None,
        **options: Unpack[GenerateOptions],
    ) -> AsyncStream:
        """As Client.stream, but an AsyncStream: `async for chunk in client.stream(...)`."""
        request = generate_request(prompt, adapter=adapter, stream=True, **options)
        timeout = options.get("timeout")
        return AsyncStream(self, request, timeout)

    async def cancel(self, request_id: str) -> None:
        """Ask the daemon to stop `request_id` (returns once sent). A waiting
        generate then returns with finish_reason "cancelled"."""
        await self._transport.send(CancelRequest(request_id=request_id))


class AsyncAdminClient(_AsyncBase):
    """asyncio client of the daemon's admin socket; see AdminClient."""

    _SOCKET = "admin"

    async def add_adapter(
        self, name: str, path: str | os.PathLike[str], *, replace: bool = False,
        timeout: float | None = ADD_ADAPTER_TIMEOUT_S,
    ) -> dict[str, object]:
        return await self._call(calls.add_adapter(name, path, replace, timeout))

    async def remove_adapter(self, name: str, *, timeout: float | None = CONTROL_TIMEOUT_S) -> dict[str, object]:
        return await self._call(calls.remove_adapter(name, timeout))

    async def pin_adapter(
        self, name: str, pinned: bool = True, *, timeout: float | None = CONTROL_TIMEOUT_S
    ) -> dict[str, object]:
        return await self._call(calls.pin_adapter(name, pinned, timeout))

    async def unpin_adapter(self, name: str, *, timeout: float | None = CONTROL_TIMEOUT_S) -> dict[str, object]:
        return await self.pin_adapter(name, False, timeout=timeout)

    async def drain(self, timeout_s: float = 30.0) -> dict[str, object]:
        return await self._call(calls.drain(timeout_s))

    async def set_policy(
        self, kind: PolicyKind, name: str, *, timeout: float | None = CONTROL_TIMEOUT_S
    ) -> dict[str, object]:
        return await self._call(calls.set_policy(kind, name, timeout))

    async def pause(self, paused: bool = True, *, timeout: float | None = CONTROL_TIMEOUT_S) -> dict[str, object]:
        return await self._call(calls.pause(paused, timeout))

    async def resume(self, *, timeout: float | None = CONTROL_TIMEOUT_S) -> dict[str, object]:
        return await self.pause(False, timeout=timeout)
