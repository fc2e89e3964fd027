"""The client's connection core, without I/O: the requests in flight and how to hand
them their replies, what the socket monitor's events mean, when to probe a silent
daemon and when to give up on it, and where the daemon is.

The sync transport (an I/O thread) and the async one (tasks on a loop) each own one
ClientCore and only move messages: whatever it decides to send (cancels, probes) it
returns. The table and the tracker take a lock so the sync client's threads can share
them. Never imports torch or numpy.
"""
from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass
from enum import Enum
from typing import Callable, Literal

import zmq

from loraplex.ipc.client_calls import Item
from loraplex.ipc.client_types import PROBE_ID_PREFIX, Liveness, new_request_id
from loraplex.ipc.errors import ErrorCode, LoraplexError, ProtocolError
from loraplex.ipc.protocol import CancelRequest, Message, PingRequest, TokenChunk
from loraplex.ipc.runtime_dir import default_runtime_dir, endpoints
from loraplex.ipc.socket_options import SocketLimits, ipc_path

log = logging.getLogger(__name__)

# Cancels queued when a client closes get this long to reach the daemon.
CLIENT_SOCKET_LIMITS = SocketLimits(linger_ms=250)

# Monitor events of the security handshake. After a failed one libzmq drops the
# connection for good, so the client fails fast from then on (see handshake_refusal).
HANDSHAKE_FAILED_EVENTS = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)
HANDSHAKE_EVENTS = HANDSHAKE_FAILED_EVENTS | zmq.EVENT_HANDSHAKE_SUCCEEDED
MONITOR_EVENTS = zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED | HANDSHAKE_EVENTS


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


def timed_out(request_id: str, timeout: float | None) -> LoraplexError:
    return LoraplexError(ErrorCode.TIMEOUT, f"no complete answer within {timeout:g} s; cancelled", request_id)


def send_failed(endpoint: str, error: Exception, request_id: str | None) -> LoraplexError:
    """The error for a message the socket refused: PeerUnavailable (the queue
    to the daemon stayed full) or ProtocolError (e.g. too large to send)."""
    if isinstance(error, ProtocolError):
        return LoraplexError(error.code, error.message, request_id)
    return LoraplexError(ErrorCode.UNAVAILABLE, f"cannot send to {endpoint}: {error}", request_id)


class ConnectionState:
    """What a client knows of its connection, from its socket monitor's events."""

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


class ClientCore:
    """One client connection's state and decisions; its transport does the I/O.

    Methods that decide to tell the daemon something return those messages (cancels
    of failed requests, which the daemon may still run if it comes back on the same
    endpoint; liveness probes) for the transport to send quietly.
    """

    def __init__(self, endpoint: str, liveness: Liveness | None, curve: bool, now: float) -> None:
        self.endpoint = endpoint
        self.link = ConnectionState(endpoint, curve)
        self.table = RequestTable()
        self._liveness = liveness
        self._tracker = LivenessTracker(liveness, now)

    def begin(self, request_id: str, deliver: Callable[[Item], None], cancellable: bool, now: float) -> bool:
        """Register a request before it is sent; True when it is the only one in flight (the
        liveness clock starts). Raises LoraplexError(unavailable) when the daemon cannot be
        reached, and (duplicate_request) for an id already in flight."""
        if reason := self.link.unreachable():
            raise LoraplexError(ErrorCode.UNAVAILABLE, reason, request_id)
        if self.table.add(request_id, deliver, cancellable):
            self._tracker.became_busy(now)
            return True
        return False

    def received(self, msg: Message, now: float) -> None:
        self._tracker.heard(now)
        if not self.table.deliver(msg):
            log.debug("dropping unsolicited %s reply", msg.TYPE)

    def undecodable(self, error: ProtocolError, now: float) -> None:
        """A frame from the daemon that did not decode: fail the request it names, if any."""
        self._tracker.heard(now)
        if error.request_id is None:
            log.warning("dropping an undecodable reply from %s: %s", self.endpoint, error)
        else:
            self.table.fail(error.request_id, LoraplexError(
                error.code, f"undecodable reply from the daemon: {error.message}", error.request_id))

    def unsent(self, msg: Message, error: LoraplexError) -> None:
        """The transport could not send `msg`: fail the request it belongs to."""
        self.table.fail(getattr(msg, "request_id", None) or "", error)

    def connection_event(self, event: int, value: int) -> list[Message]:
        change = self.link.update(event, value)
        if change == "refused":
            self.table.fail_all(ErrorCode.UNAVAILABLE, self.link.refused or "")
        elif change == "lost":
            return self.fail_in_flight(f"lost the connection to the daemon at {self.endpoint}")
        return []

    def check_liveness(self, now: float) -> tuple[list[Message], float | None]:
        """What to send now (a probe, or cancels of what was failed), and the seconds until
        the next check (None: when a request starts)."""
        action, wait_s = self._tracker.check(now, busy=len(self.table) > 0)
        if action is Probe.PING:
            return [PingRequest(request_id=new_request_id(PROBE_ID_PREFIX))], wait_s
        if action is Probe.FAIL and self._liveness is not None:
            reason = f"the daemon at {self.endpoint} is not answering: {self._liveness.describe()}"
            return self.fail_in_flight(reason), wait_s
        return [], wait_s

    def fail_in_flight(self, reason: str) -> list[Message]:
        """Fail every request in flight (unavailable); the cancels of the generates among them."""
        return [CancelRequest(request_id=rid) for rid in self.table.fail_all(ErrorCode.UNAVAILABLE, reason)]
