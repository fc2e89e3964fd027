"""Blocking client library: Client (generate, stream, cancel, adapters, stats,
ping) and AdminClient (the admin socket), for scripts and threaded programs.

Thread-safety: every method of Client and AdminClient may be called from any
number of threads at once. One background I/O thread per client owns its
single DEALER socket; callers hand it messages through a queue and wait on a
per-request queue that the I/O thread fills by request id. A Stream is an
iterator for one consumer thread at a time (its close() is safe from any).
"""
from __future__ import annotations

import logging
import os
import queue
import threading
import time
from typing import TYPE_CHECKING, Sequence, TypeVar

import zmq
from zmq.utils.monitor import recv_monitor_message

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
from loraplex.ipc.curve import CurveClientKeys
from loraplex.ipc.errors import ErrorCode, LoraplexError, ProtocolError
from loraplex.ipc.protocol import CancelRequest, GenerateRequest, Message, PolicyKind
from loraplex.ipc.socket_options import SocketLimits
from loraplex.ipc.sockets import PeerUnavailable, make_dealer

if TYPE_CHECKING:  # typing.Unpack is Python 3.11+; annotations are not evaluated (3.10 supported)
    from typing import Unpack

log = logging.getLogger(__name__)
_B = TypeVar("_B", bound="_SyncBase")


class _Transport:
    """One DEALER owned by one I/O thread; any thread may start and wait on requests."""

    def __init__(
        self, endpoint: str, limits: SocketLimits, liveness: Liveness | None, context: zmq.Context | None,
        curve: CurveClientKeys | None = None,
    ) -> None:
        self.endpoint = endpoint
        self._core = ClientCore(endpoint, liveness, curve is not None, time.monotonic())
        self._outbox: queue.SimpleQueue[Message] = queue.SimpleQueue()
        # Reentrant: a Stream finalizer (cyclic GC) may post a cancel from any
        # point of a thread that already holds it.
        self._post_lock = threading.RLock()
        self._closed = False
        ctx = context if context is not None else zmq.Context.instance()
        self._sock = make_dealer(ctx, endpoint, limits=limits, curve=curve, monitor_events=MONITOR_EVENTS)
        self._monitor = self._sock.monitor
        self._send_wait_s = limits.send_timeout_ms / 1e3
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._thread = threading.Thread(target=self._run, name=f"loraplex-client {endpoint}", daemon=True)
        self._thread.start()

    # -- caller side (any thread) --------------------------------------
    def start(self, msg: Message, request_id: str, cancellable: bool) -> queue.SimpleQueue[Item]:
        """Register `request_id` and queue `msg` for sending; its replies arrive on the returned queue."""
        replies: queue.SimpleQueue[Item] = queue.SimpleQueue()
        with self._post_lock:
            if self._closed:
                raise LoraplexError(ErrorCode.UNAVAILABLE, "the client is closed", request_id)
            self._core.begin(request_id, replies.put, cancellable, time.monotonic())
            self._post_locked(msg)
        return replies

    def post(self, msg: Message) -> bool:
        """Queue `msg` for sending (fire and forget); False once closed."""
        with self._post_lock:
            if self._closed:
                return False
            self._post_locked(msg)
            return True

    def _post_locked(self, msg: Message) -> None:
        self._outbox.put(msg)
        try:
            os.write(self._wake_w, b"\0")
        except BlockingIOError:
            pass  # the pipe is full of wake-ups already

    def abandon(self, request_id: str) -> None:
        """Stop waiting for `request_id`, cancelling it if it was still in flight."""
        if self._core.table.discard(request_id):
            self.post(CancelRequest(request_id=request_id))

    def forget(self, request_id: str) -> None:
        """Stop waiting for `request_id` without cancelling it (control calls)."""
        self._core.table.discard(request_id)

    @staticmethod
    def wait(replies: queue.SimpleQueue[Item], deadline: float | None) -> Item:
        """The next reply; TimeoutError once `deadline` (monotonic) passes."""
        if deadline is None:
            return replies.get()
        try:
            return replies.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            raise TimeoutError from None

    def close(self, wait: bool = True) -> None:
        """Stop the I/O thread (it fails and cancels what is in flight); with
        `wait`, until it has closed the socket."""
        with self._post_lock:
            if self._closed:
                return
            self._closed = True
            os.write(self._wake_w, b"\0")
        if wait and threading.current_thread() is not self._thread:
            self._thread.join(timeout=10.0)

    # -- I/O thread ----------------------------------------------------
    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock.socket, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        wait_s: float | None = None
        try:
            while not self._closed:
                ready = dict(poller.poll(None if wait_s is None else max(1, int(wait_s * 1000) + 1)))
                if self._wake_r in ready:
                    self._drain_wake()
                self._flush_outbox()
                if self._sock.socket in ready:
                    self._drain_socket()
                if self._monitor in ready:
                    self._drain_monitor()
                wait_s = self._check_liveness()
        except Exception:
            log.exception("loraplex client I/O thread failed")
        finally:
            self._shutdown()

    def _drain_wake(self) -> None:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except BlockingIOError:
            pass

    def _flush_outbox(self) -> None:
        while True:
            try:
                msg = self._outbox.get_nowait()
            except queue.Empty:
                return
            self._send(msg)

    def _await_handshake(self) -> None:
        """tcp: until the first handshake, watch the monitor instead of blocking in send, so a
        refused handshake (CURVE) fails the request at once rather than after SNDTIMEO."""
        link = self._core.link
        deadline = time.monotonic() + self._send_wait_s
        while not link.handshaken and link.refused is None and time.monotonic() < deadline:
            if self._monitor.poll(50):
                self._drain_monitor()

    def _send(self, msg: Message) -> None:
        link = self._core.link
        if self.endpoint.startswith("tcp://") and not link.handshaken:
            self._await_handshake()
        if link.refused is not None:  # no connection to send on: it would only wait for SNDTIMEO
            request_id = getattr(msg, "request_id", None)
            self._core.unsent(msg, LoraplexError(ErrorCode.UNAVAILABLE, link.refused, request_id))
            return
        try:
            self._sock.send(msg)
        except (PeerUnavailable, ProtocolError) as exc:
            self._drain_monitor()  # a handshake refused while the send waited fails it with the reason
            self._core.unsent(msg, send_failed(self.endpoint, exc, getattr(msg, "request_id", None)))

    def _send_all(self, messages: list[Message]) -> None:
        for msg in messages:
            self._send(msg)

    def _drain_socket(self) -> None:
        for _ in range(10_000):  # bounded, so queued sends are not starved
            if not self._sock.poll(0):
                return
            try:
                _, msg = self._sock.recv()
            except ProtocolError as exc:
                self._core.undecodable(exc, time.monotonic())
                continue
            self._core.received(msg, time.monotonic())

    def _drain_monitor(self) -> None:
        while self._monitor.poll(0):
            message = recv_monitor_message(self._monitor)
            self._send_all(self._core.connection_event(message["event"], message["value"]))

    def _check_liveness(self) -> float | None:
        messages, wait_s = self._core.check_liveness(time.monotonic())
        self._send_all(messages)
        return wait_s

    def _shutdown(self) -> None:
        with self._post_lock:
            self._closed = True
        try:
            self._sock.socket.setsockopt(zmq.SNDTIMEO, 0)  # closing must not wait on a full queue
            self._flush_outbox()
            self._send_all(self._core.fail_in_flight("the client was closed"))
        except Exception:
            log.exception("loraplex client failed while closing")
            self._core.table.fail_all(ErrorCode.UNAVAILABLE, "the client was closed")
        finally:
            self._sock.close()  # and its monitor
            os.close(self._wake_r)
            os.close(self._wake_w)


class Stream:
    """Iterator over the chunks of one streamed generate.

    End convention: when the iteration ends normally (StopIteration), `.result`
    holds the GenerateResult from the daemon's `done` (the whole text, usage,
    timings); before that it is None. Errors raise LoraplexError from next().
    Leaving early cancels the request on the daemon: close(), a `with` block,
    or dropping the iterator (immediate for `for c in client.stream(...)`).
    """

    def __init__(self, client: _SyncBase, request: GenerateRequest, timeout: float | None) -> None:
        self._client = client  # keeps the client (and its socket) alive while we iterate
        self._transport = client._transport
        self.request_id = request.request_id
        self._timeout = timeout
        self._deadline = None if timeout is None else time.monotonic() + timeout
        self._assembler = StreamAssembler(request)
        self._open = False
        self._replies = self._transport.start(request, request.request_id, cancellable=True)
        self._open = True

    @property
    def result(self) -> GenerateResult | None:
        return self._assembler.result

    def finished_result(self) -> GenerateResult:
        """The result of a stream read to its end."""
        return self._assembler.finished_result()

    def __iter__(self) -> Stream:
        return self

    def __next__(self) -> StreamChunk:
        if not self._open:
            raise StopIteration
        try:
            item = self._transport.wait(self._replies, self._deadline)
        except TimeoutError:
            self.close()
            raise timed_out(self.request_id, self._timeout) from None
        except BaseException:
            self.close()
            raise
        try:
            chunk = self._assembler.feed(item)
        except LoraplexError:
            self._open = False
            raise
        if chunk is None:
            self._open = False
            raise StopIteration
        return chunk

    def close(self) -> None:
        """Stop reading; cancels the request if the daemon has not finished it."""
        if self._open:
            self._open = False
            self._transport.abandon(self.request_id)

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if getattr(self, "_open", False):
            self.close()


class _SyncBase:
    """Construction, lifecycle and the calls both sockets answer (adapters, stats, ping)."""

    _SOCKET = "client"  # which of the runtime directory's sockets is the default

    def __init__(
        self,
        endpoint: str | None = None,
        *,
        runtime_dir: str | os.PathLike[str] | None = None,
        liveness: Liveness | None = Liveness(),
        limits: SocketLimits = CLIENT_SOCKET_LIMITS,
        context: zmq.Context | None = None,
        curve: CurveClientKeys | None = None,
    ) -> None:
        self.endpoint = resolve_endpoint(endpoint, runtime_dir, self._SOCKET)
        self._transport = _Transport(self.endpoint, limits, liveness, context, curve)

    def close(self) -> None:
        """Fail and cancel whatever is in flight, then close the socket. Idempotent."""
        self._transport.close()

    def __enter__(self: _B) -> _B:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        transport = getattr(self, "_transport", None)
        if transport is not None:
            transport.close(wait=False)

    def _call(self, call: Call[R]) -> R:
        """Send `call`'s request and wait for its reply (at most its timeout)."""
        deadline = None if call.timeout is None else time.monotonic() + call.timeout
        replies = self._transport.start(call.request, call.request_id, cancellable=False)
        try:
            item = self._transport.wait(replies, deadline)
        except TimeoutError:
            raise timed_out(call.request_id, call.timeout) from None
        finally:
            self._transport.forget(call.request_id)
        return call.finish(item)

    def adapters(self, *, timeout: float | None = CONTROL_TIMEOUT_S) -> list[AdapterInfo]:
        """The registered adapters."""
        return self._call(calls.list_adapters(timeout))

    def tokenize(self, text: str, *, timeout: float | None = CONTROL_TIMEOUT_S) -> Tokenized:
        """`text`'s token ids under the daemon's tokenizer (as a prompt gets them), and the context length."""
        return self._call(calls.tokenize(text, timeout))

    def detokenize(self, token_ids: Sequence[int], *, timeout: float | None = CONTROL_TIMEOUT_S) -> str:
        """The text of `token_ids` (special tokens kept)."""
        return self._call(calls.detokenize(token_ids, timeout))

    def stats(self, *, timeout: float | None = CONTROL_TIMEOUT_S) -> dict[str, object]:
        """One snapshot of the daemon's metrics."""
        return self._call(calls.stats(timeout))

    def ping(self, *, timeout: float | None = CONTROL_TIMEOUT_S) -> float:
        """Round-trip time to the daemon in seconds."""
        return self._call(calls.ping(timeout))


class Client(_SyncBase):
    """Blocking client of the daemon's client socket; thread-safe (see module doc).

    endpoint: "ipc://..." or "tcp://..."; default: the client socket in
    `runtime_dir`, else $LORAPLEX_RUNTIME_DIR, else the default runtime dir.
    liveness: when to give up on a silent daemon (None: only a closed
    connection fails requests early). context: a zmq.Context to share
    (default: the process-wide instance). limits: socket limits and timers.
    curve: CurveClientKeys for a tcp:// endpoint served with CURVE; a daemon
    that refuses the handshake fails every request with `unavailable` and the
    reason (a refused connection is not retried: make a new client).
    """

    def generate(
        self,
        prompt: str | Sequence[int],
        adapter: str | None = None,
        **options: Unpack[GenerateOptions],
    ) -> GenerateResult:
        """Generate a completion of `prompt` (text or token ids) with `adapter`
        (None: the base model) and wait for it.

        top_logprobs, the penalties, logit_bias (token id -> bias), min_tokens, n (GenerateResult.choices)
        and guided (Guided.json(schema), .regex(...), ...) act as in vLLM (ipc.messages.client.GenerateRequest).
        prompt_logprobs=k (0..20): GenerateResult.prompt_logprobs, as vLLM's prompt_logprobs.
        max_tokens: new tokens at most; None fills what the context leaves after
        the prompt. A prompt plus max_tokens longer than the model's context
        fails at once with LoraplexError(context_length_exceeded), as vLLM's 400.
        timeout: seconds for the whole request (None: no limit, but a lost or
        hung daemon still fails it, see Liveness); on expiry the request is
        cancelled and LoraplexError(timeout) raised. request_id: your own id
        (to cancel() it from another thread); default: a fresh one.
        Raises LoraplexError for every failure the daemon reports, ValueError
        for out-of-range arguments.
        """
        request = generate_request(prompt, adapter=adapter, stream=False, **options)
        timeout = options.get("timeout")
        stream = Stream(self, request, timeout)
        with stream:
            for _ in stream:
                pass
        return stream.finished_result()

    def stream(
        self,
        prompt: str | Sequence[int],
        adapter: str | None = None,
        **options: Unpack[GenerateOptions],
    ) -> Stream:
        """As generate(), but returns at once with a Stream of chunks; the
        request is sent before this returns. See Stream for the end convention."""
        request = generate_request(prompt, adapter=adapter, stream=True, **options)
        timeout = options.get("timeout")
        return Stream(self, request, timeout)

    def cancel(self, request_id: str) -> None:
        """Ask the daemon to stop `request_id` (fire and forget). A waiting
        generate then returns with finish_reason "cancelled"."""
        msg = CancelRequest(request_id=request_id)
        if not self._transport.post(msg):
            raise LoraplexError(ErrorCode.UNAVAILABLE, "the client is closed", request_id)


class AdminClient(_SyncBase):
    """Blocking client of the daemon's admin socket; thread-safe. Arguments
    as for Client; the default endpoint is the runtime directory's admin socket.
    Each call returns the `detail` map of the daemon's `admin_ok` reply."""

    _SOCKET = "admin"

    def add_adapter(
        self, name: str, path: str | os.PathLike[str], *, replace: bool = False,
        timeout: float | None = ADD_ADAPTER_TIMEOUT_S,
    ) -> dict[str, object]:
        """Register the adapter at `path` (absolute, on the daemon's host) as `name`; `replace`: give an
        existing `name` these weights (detail["changed"] says whether its content differed)."""
        return self._call(calls.add_adapter(name, path, replace, timeout))

    def remove_adapter(self, name: str, *, timeout: float | None = CONTROL_TIMEOUT_S) -> dict[str, object]:
        return self._call(calls.remove_adapter(name, timeout))

    def pin_adapter(
        self, name: str, pinned: bool = True, *, timeout: float | None = CONTROL_TIMEOUT_S
    ) -> dict[str, object]:
        """Keep `name` GPU-resident (pinned=False: make it evictable again)."""
        return self._call(calls.pin_adapter(name, pinned, timeout))

    def unpin_adapter(self, name: str, *, timeout: float | None = CONTROL_TIMEOUT_S) -> dict[str, object]:
        return self.pin_adapter(name, False, timeout=timeout)

    def drain(self, timeout_s: float = 30.0) -> dict[str, object]:
        """Stop admitting requests and wait up to `timeout_s` for running ones."""
        return self._call(calls.drain(timeout_s))

    def set_policy(
        self, kind: PolicyKind, name: str, *, timeout: float | None = CONTROL_TIMEOUT_S
    ) -> dict[str, object]:
        """Switch the "scheduler" or "cache" policy, or the engine "router", to the one called `name`."""
        return self._call(calls.set_policy(kind, name, timeout))

    def pause(self, paused: bool = True, *, timeout: float | None = CONTROL_TIMEOUT_S) -> dict[str, object]:
        """Hold scheduling (requests queue up, no new step starts) or, with paused=False, resume it."""
        return self._call(calls.pause(paused, timeout))

    def resume(self, *, timeout: float | None = CONTROL_TIMEOUT_S) -> dict[str, object]:
        return self.pause(False, timeout=timeout)
