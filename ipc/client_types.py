"""What the sync and async client libraries share: result types, request
building, endpoint discovery, the request table and the liveness rules.

Pure Python over the protocol classes: no sockets, no threads, no event loop
(the table and tracker take a lock so the sync client's threads can share
them). Never imports torch or numpy.
"""
from __future__ import annotations

import os
import threading
import uuid
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Callable, Literal, Mapping, Sequence, TypeVar, Union

import zmq

from loraplex.ipc.errors import ErrorCode, LoraplexError, ProtocolError
from loraplex.ipc.protocol import (
    MAX_DEADLINE_MS,
    DoneReply,
    ErrorReply,
    GenerateRequest,
    Message,
    PolicyKind,
    TokenChunk,
)
from loraplex.ipc.runtime_dir import default_runtime_dir, endpoints
from loraplex.ipc.socket_options import SocketLimits, ipc_path

# Cancels queued when a client closes get this long to reach the daemon.
CLIENT_SOCKET_LIMITS = SocketLimits(linger_ms=250)
REQUEST_ID_PREFIX = "lpx-"
PROBE_ID_PREFIX = "lpx-probe-"

# What a waiting caller receives: a reply for its request id, or a local failure.
Item = Union[Message, LoraplexError]
M = TypeVar("M", bound=Message)


def new_request_id(prefix: str = REQUEST_ID_PREFIX) -> str:
    """A fresh client-side request id: prefix + uuid4 hex (unique without coordination)."""
    return f"{prefix}{uuid.uuid4().hex}"


def resolve_endpoint(endpoint: str | None, runtime_dir: str | os.PathLike[str] | None, which: str) -> str:
    """`endpoint` when given (ipc:// or tcp://), else the daemon's `which`
    ("client" or "admin") socket in `runtime_dir`, else in
    $LORAPLEX_RUNTIME_DIR or the default runtime directory."""
    if endpoint is not None:
        if not isinstance(endpoint, str) or not endpoint.startswith(("ipc://", "tcp://")):
            raise ValueError(f"endpoint must be an ipc:// or tcp:// address, got {endpoint!r}")
        return endpoint
    found = endpoints(runtime_dir if runtime_dir is not None else default_runtime_dir())
    return found.client if which == "client" else found.admin


def missing_daemon(endpoint: str) -> str | None:
    """Why no daemon can be listening at `endpoint` (its socket file is absent), else None."""
    path = ipc_path(endpoint)
    if path is None or path.exists():
        return None
    return (
        f"no loraplex daemon is listening at {endpoint} (the socket file does not exist); "
        "start the daemon, or point the client at it with endpoint= or $LORAPLEX_RUNTIME_DIR"
    )


# Monitor events of the security handshake. After a failed one libzmq drops the
# connection for good, so the client fails fast from then on (see handshake_refusal).
HANDSHAKE_FAILED_EVENTS = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)
HANDSHAKE_EVENTS = HANDSHAKE_FAILED_EVENTS | zmq.EVENT_HANDSHAKE_SUCCEEDED


def handshake_refusal(endpoint: str, event: int, value: int, curve: bool) -> str:
    """Why the daemon at `endpoint` would not talk to us, from a failed-handshake
    monitor event (`value`: the ZAP status or libzmq's protocol error code)."""
    if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        return (f"the daemon at {endpoint} refused this client's CURVE key (status {value}): "
                "its public key is not in the daemon's server.tcp_curve_allowed_keys")
    mismatch = event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL and value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH
    if not curve:
        hint = "it requires CURVE" if mismatch else "it probably requires CURVE"
        return (f"the daemon at {endpoint} refused an unencrypted connection ({hint}: give the client the "
                "server's public key and a client key pair, e.g. --curve-server-key/--curve-client-key)")
    if mismatch:
        return f"the daemon at {endpoint} does not use CURVE on this endpoint; connect without CURVE keys"
    return f"the CURVE handshake with the daemon at {endpoint} failed: is the server public key the right one?"


class ConnectionState:
    """What a client knows of its connection, from its socket monitor's events.
    Shared by the sync and async transports; each updates it from one thread or loop."""

    def __init__(self, endpoint: str, curve: bool) -> None:
        self.endpoint = endpoint
        self.curve = curve
        self.connected = False
        self.handshaken = False  # a handshake with the daemon succeeded at least once
        self.refused: str | None = None  # why the daemon refused our handshake (the connection is gone)

    def update(self, event: int, value: int) -> Literal["refused", "lost"] | None:
        """Apply one event. "refused": fail the requests in flight, nothing to cancel
        (none reached the daemon); "lost": fail them and cancel them on the daemon."""
        if event == zmq.EVENT_CONNECTED:
            self.connected = True
        elif event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self.refused = None
            self.handshaken = True
        elif event & HANDSHAKE_FAILED_EVENTS:
            self.connected = False
            self.refused = handshake_refusal(self.endpoint, event, value, self.curve)
            return "refused"
        elif event == zmq.EVENT_DISCONNECTED:
            self.connected = False
            return "lost"
        return None

    def unreachable(self) -> str | None:
        """Why a new request cannot reach the daemon now (refused, or no socket file), else None."""
        if self.connected:
            return None
        return self.refused or missing_daemon(self.endpoint)


def check_timeout(timeout: float | None) -> float | None:
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0):
        raise ValueError(f"timeout must be a positive number of seconds or None, got {timeout!r}")
    return None if timeout is None else float(timeout)


def generate_request(
    prompt: str | Sequence[int],
    *,
    request_id: str | None,
    adapter: str | None,
    max_tokens: int | None,
    temperature: float,
    top_p: float,
    top_k: int,
    seed: int | None,
    stop: str | Sequence[str] | None,
    stop_token_ids: Sequence[int] | None,
    ignore_eos: bool,
    logprobs: bool,
    priority: int,
    slo_ttft_ms: float | None,
    timeout: float | None,
    stream: bool,
) -> GenerateRequest:
    """The validated `generate` message for the client methods' arguments.

    Requests logprobs as a stream even for a plain generate, because only
    `token` chunks carry logprobs. The timeout also becomes the daemon-side
    deadline, so a timed-out request is dropped there even if our cancel is lost.
    Raises ValueError (ProtocolError for fields) for out-of-range arguments.
    """
    timeout = check_timeout(timeout)
    if isinstance(prompt, str):
        text, ids = prompt, None
    elif isinstance(prompt, Sequence) and not isinstance(prompt, (bytes, bytearray)):
        text, ids = None, list(prompt)
    else:
        raise TypeError(f"prompt must be a str or a sequence of token ids, got {type(prompt).__name__}")
    deadline_ms = None if timeout is None or timeout * 1000.0 > MAX_DEADLINE_MS else timeout * 1000.0
    return GenerateRequest(
        request_id=request_id if request_id is not None else new_request_id(),
        prompt=text,
        prompt_token_ids=ids,
        adapter=adapter,
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        seed=seed,
        stop=[stop] if isinstance(stop, str) else list(stop or ()),
        stop_token_ids=list(stop_token_ids or ()),
        ignore_eos=ignore_eos,
        stream=stream or logprobs,
        logprobs=logprobs,
        priority=priority,
        slo_ttft_ms=slo_ttft_ms,
        deadline_ms=deadline_ms,
    )


@dataclass(frozen=True, slots=True)
class StreamChunk:
    """Tokens of one `token` reply. `index` is the completion position of the
    first token; `logprobs` has one entry per token id when requested."""

    request_id: str
    token_ids: list[int]
    text: str
    index: int
    logprobs: list[float] | None = None


@dataclass(frozen=True, slots=True)
class GenerateResult:
    """A finished generate, from the daemon's `done` reply.

    finish_reason: "stop", "length", "cancelled" (after `cancel`) or "error".
    usage: prompt_tokens, completion_tokens (and whatever else the daemon counts).
    timings: milliseconds queue_ms, e2e_ms (always), ttft_ms, tpt_ms (once a
    token was produced) and adapter_path ("base", "cached", "loaded" or
    "cpu_assisted"). logprobs: one per completion token when requested, else None.
    """

    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str
    usage: dict[str, int]
    timings: dict[str, float | str]
    logprobs: list[float] | None = None


@dataclass(frozen=True, slots=True)
class AdapterInfo:
    """One registered adapter; `extra` holds the daemon's informational keys
    (pinned, hits, resident pages...)."""

    name: str
    path: str
    rank: int
    target_modules: tuple[str, ...]
    state: str
    extra: Mapping[str, object] = field(default_factory=dict)

    @classmethod
    def from_entry(cls, entry: Mapping[str, Any]) -> AdapterInfo:
        known = ("name", "path", "rank", "target_modules", "state")
        return cls(
            name=entry["name"],
            path=entry["path"],
            rank=entry["rank"],
            target_modules=tuple(entry["target_modules"]),
            state=entry["state"],
            extra={k: v for k, v in entry.items() if k not in known},
        )


def expect(item: Item, cls: type[M], request_id: str) -> M:
    """`item` if it is the `cls` reply; raise the daemon's error or a local one otherwise."""
    if isinstance(item, LoraplexError):
        raise item
    if isinstance(item, ErrorReply):
        raise item.to_exception()
    if not isinstance(item, cls):
        raise LoraplexError(ErrorCode.BAD_MESSAGE, f"expected a {cls.TYPE} reply, got {item.TYPE}", request_id)
    return item


def timed_out(request_id: str, timeout: float | None) -> LoraplexError:
    return LoraplexError(ErrorCode.TIMEOUT, f"no complete answer within {timeout:g} s; cancelled", request_id)


def send_failed(endpoint: str, error: Exception, request_id: str | None) -> LoraplexError:
    """The error for a message the socket refused: PeerUnavailable (the queue
    to the daemon stayed full) or ProtocolError (e.g. too large to send)."""
    if isinstance(error, ProtocolError):
        return LoraplexError(error.code, error.message, request_id)
    return LoraplexError(ErrorCode.UNAVAILABLE, f"cannot send to {endpoint}: {error}", request_id)


def undecodable_reply(error: ProtocolError) -> LoraplexError:
    return LoraplexError(error.code, f"undecodable reply from the daemon: {error.message}", error.request_id)


class StreamAssembler:
    """Turns the replies of one generate into chunks, then one result."""

    def __init__(self, request_id: str, want_logprobs: bool) -> None:
        self.request_id = request_id
        self.result: GenerateResult | None = None
        self._logprobs: list[float] | None = [] if want_logprobs else None

    def finished_result(self) -> GenerateResult:
        if self.result is None:
            raise RuntimeError(f"request {self.request_id} has not finished; read its stream to the end first")
        return self.result

    def feed(self, item: Item) -> StreamChunk | None:
        """The chunk in `item`; None once `item` finished the request (see
        `.result`); raises LoraplexError for an error reply or local failure."""
        if isinstance(item, TokenChunk):
            if self._logprobs is not None and item.logprobs is not None:
                self._logprobs.extend(item.logprobs)
            return StreamChunk(item.request_id, item.token_ids, item.text, item.index, item.logprobs)
        done = expect(item, DoneReply, self.request_id)
        self.result = GenerateResult(
            request_id=done.request_id,
            text=done.text,
            token_ids=done.token_ids,
            finish_reason=done.finish_reason,
            usage=dict(done.usage),
            timings=dict(done.timings),
            logprobs=self._logprobs,
        )
        return None


@dataclass(slots=True)
class _Entry:
    deliver: Callable[[Item], None]
    cancellable: bool


class RequestTable:
    """In-flight request ids -> how to hand them their replies. Thread-safe.

    A `token` reply keeps its request in the table; any other reply, or a
    local failure, removes it, so a caller that stopped waiting leaks nothing.
    """

    def __init__(self) -> None:
        # Reentrant: stream finalizers discard entries and may run (cyclic
        # GC) inside any of these methods on the same thread.
        self._lock = threading.RLock()
        self._entries: dict[str, _Entry] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, request_id: str, deliver: Callable[[Item], None], cancellable: bool) -> bool:
        """Register a request; True when the table was empty before."""
        with self._lock:
            if request_id in self._entries:
                raise LoraplexError(ErrorCode.DUPLICATE_REQUEST, "request id already in flight", request_id)
            self._entries[request_id] = _Entry(deliver, cancellable)
            return len(self._entries) == 1

    def discard(self, request_id: str) -> bool:
        """Forget a request; True if it was still in flight."""
        with self._lock:
            return self._entries.pop(request_id, None) is not None

    def deliver(self, msg: Message) -> bool:
        """Hand `msg` to its request; False when no request of ours wants it
        (a probe's pong, a reply that arrived after its caller gave up)."""
        request_id = getattr(msg, "request_id", None)
        if not isinstance(request_id, str):
            return False
        with self._lock:
            entry = self._entries.get(request_id)
            if entry is not None and not isinstance(msg, TokenChunk):
                del self._entries[request_id]
        if entry is None:
            return False
        entry.deliver(msg)
        return True

    def fail(self, request_id: str, error: LoraplexError) -> None:
        with self._lock:
            entry = self._entries.pop(request_id, None)
        if entry is not None:
            entry.deliver(error)

    def fail_all(self, code: ErrorCode, message: str) -> list[str]:
        """Fail every request; returns the ids of generates (to cancel)."""
        with self._lock:
            entries, self._entries = self._entries, {}
        for request_id, entry in entries.items():
            entry.deliver(LoraplexError(code, message, request_id))
        return [rid for rid, entry in entries.items() if entry.cancellable]


@dataclass(frozen=True, slots=True)
class Liveness:
    """When a client suspects a silent daemon, while requests are in flight.

    After `probe_after_s` without any message from the daemon the client sends
    a ping; if nothing at all arrives within `probe_timeout_s` after it, every
    in-flight request fails with code `unavailable`. (A closed connection,
    e.g. the daemon process died, fails them at once without waiting.)
    """

    probe_after_s: float = 5.0
    probe_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        for name in ("probe_after_s", "probe_timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 86_400:
                raise ValueError(f"Liveness.{name} must be in (0, 86400] seconds, got {value!r}")

    def describe(self) -> str:
        return f"no message for {self.probe_after_s:g} s and no answer to a ping within {self.probe_timeout_s:g} s"


class Probe(Enum):
    NONE = "none"
    PING = "ping"
    FAIL = "fail"


class LivenessTracker:
    """Decides when to ping and when to give up on the daemon (see Liveness).

    Times are time.monotonic() seconds passed in by the caller. Thread-safe.
    """

    def __init__(self, liveness: Liveness | None, now: float) -> None:
        self._cfg = liveness
        self._lock = threading.Lock()
        self._quiet_since = now
        self._probe_sent_at: float | None = None

    def became_busy(self, now: float) -> None:
        """A request started while none was in flight: silence counts from now."""
        with self._lock:
            self._quiet_since = now
            self._probe_sent_at = None

    def heard(self, now: float) -> None:
        """Any message arrived from the daemon."""
        with self._lock:
            self._quiet_since = now
            self._probe_sent_at = None

    def check(self, now: float, busy: bool) -> tuple[Probe, float | None]:
        """What to do now, and the seconds until the next check (None: only
        when a request starts)."""
        cfg = self._cfg
        with self._lock:
            if cfg is None or not busy:
                self._probe_sent_at = None
                return Probe.NONE, None
            if self._probe_sent_at is not None:
                waited = now - self._probe_sent_at
                if waited >= cfg.probe_timeout_s:
                    self._probe_sent_at = None
                    self._quiet_since = now
                    return Probe.FAIL, cfg.probe_after_s
                return Probe.NONE, cfg.probe_timeout_s - waited
            quiet = now - self._quiet_since
            if quiet >= cfg.probe_after_s:
                self._probe_sent_at = now
                return Probe.PING, cfg.probe_timeout_s
            return Probe.NONE, cfg.probe_after_s - quiet
