"""Socket limits and the one function that applies them to every ZMQ socket.

Owns SocketLimits, the option set (LINGER, bounded HWMs, MAXMSGSIZE,
heartbeats, IPv6 off, ROUTER_MANDATORY) and the filesystem side of ipc://
binds: private directory, refusing to steal a live socket, 0600 file mode.
Never sends or receives.
"""
from __future__ import annotations

import errno
import os
import socket
import stat
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path

import zmq

from loraplex.ipc.codec import DEFAULT_LIMITS, DecodeLimits
from loraplex.ipc.runtime_dir import MAX_IPC_PATH_BYTES, ensure_runtime_dir

# libzmq stores the heartbeat TTL in deciseconds in a 16-bit field.
MAX_HEARTBEAT_TTL_MS = 6_553_599


class SocketKind(str, Enum):
    ROUTER = "router"
    DEALER = "dealer"
    PUB = "pub"
    SUB = "sub"

    @property
    def zmq_type(self) -> int:
        return {"router": zmq.ROUTER, "dealer": zmq.DEALER, "pub": zmq.PUB, "sub": zmq.SUB}[self.value]


class EndpointInUse(OSError):
    """Another process is listening on the ipc:// path we were asked to bind."""


@dataclass(frozen=True, slots=True)
class SocketLimits:
    """Bounds and timers for one socket; every field has a production default.

    decode: message limits; decode.max_message_bytes becomes MAXMSGSIZE, so a
      peer sending a larger frame is disconnected by libzmq.
    sndhwm/rcvhwm: queued messages per peer (never 0 = unbounded).
    linger_ms: how long close() may wait for unsent messages.
    send_timeout_ms: how long a DEALER send may block on a full queue before
      raising PeerUnavailable; ROUTER and PUB sends never block.
    heartbeat_*: ZMTP PING interval, pong timeout and the TTL a peer should
      keep us for; 0 interval disables heartbeats.
    """

    decode: DecodeLimits = field(default=DEFAULT_LIMITS)
    sndhwm: int = 1000
    rcvhwm: int = 1000
    linger_ms: int = 0
    send_timeout_ms: int = 5000
    heartbeat_ivl_ms: int = 1000
    heartbeat_timeout_ms: int = 5000
    heartbeat_ttl_ms: int = 10_000

    def __post_init__(self) -> None:
        if not isinstance(self.decode, DecodeLimits):
            raise ValueError(f"SocketLimits.decode must be a DecodeLimits, got {type(self.decode).__name__}")
        bounds = {
            "sndhwm": (1, 10_000_000),
            "rcvhwm": (1, 10_000_000),
            "linger_ms": (0, 600_000),
            "send_timeout_ms": (0, 3_600_000),
            "heartbeat_ivl_ms": (0, 3_600_000),
            "heartbeat_timeout_ms": (0, 3_600_000),
            "heartbeat_ttl_ms": (0, MAX_HEARTBEAT_TTL_MS),
        }
        for name, (lo, hi) in bounds.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
                raise ValueError(f"SocketLimits.{name} must be an int in [{lo}, {hi}], got {value!r}")

    @property
    def max_message_bytes(self) -> int:
        return self.decode.max_message_bytes


DEFAULT_SOCKET_LIMITS = SocketLimits()
# The private ipc:// links between the daemon and the children it starts (engines, the cache
# manager, CPU workers): each child's liveness is its heartbeat pipe's job. ZMTP heartbeats there
# dropped the connection of a side paused past their timeout (a SIGSTOPped daemon, a long stall of
# a loaded host); the child then reconnected under a new routing id and the daemon's next order
# went to the old one, unanswered, until the step deadline killed a healthy engine.
CHILD_LINK_LIMITS = SocketLimits(heartbeat_ivl_ms=0)


def configure(sock: zmq.Socket, kind: SocketKind, limits: SocketLimits) -> None:
    """Apply every option; must run before bind/connect (HWMs are per pipe)."""
    sock.setsockopt(zmq.LINGER, limits.linger_ms)
    sock.setsockopt(zmq.SNDHWM, limits.sndhwm)
    sock.setsockopt(zmq.RCVHWM, limits.rcvhwm)
    sock.setsockopt(zmq.MAXMSGSIZE, limits.max_message_bytes)
    sock.setsockopt(zmq.IPV6, 0)
    sock.setsockopt(zmq.SNDTIMEO, limits.send_timeout_ms)
    # Receives are bounded by the caller (poll with a timeout), never here.
    sock.setsockopt(zmq.RCVTIMEO, -1)
    if limits.heartbeat_ivl_ms:
        sock.setsockopt(zmq.HEARTBEAT_IVL, limits.heartbeat_ivl_ms)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, limits.heartbeat_timeout_ms)
        sock.setsockopt(zmq.HEARTBEAT_TTL, limits.heartbeat_ttl_ms)
    if kind is SocketKind.ROUTER:
        # Unknown identities raise EHOSTUNREACH and full queues raise EAGAIN
        # instead of the message vanishing silently.
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    if kind is SocketKind.SUB:
        sock.setsockopt(zmq.SUBSCRIBE, b"")


def ipc_path(endpoint: str) -> Path | None:
    """The socket file of a filesystem ipc:// endpoint, else None."""
    if not endpoint.startswith("ipc://"):
        return None
    rest = endpoint[len("ipc://"):]
    if rest.startswith("@"):
        return None  # Linux abstract namespace: no file, no permissions.
    return Path(rest)


def is_listening(path: Path) -> bool:
    """Whether a process accepts connections on the Unix socket `path` (False: none, or no file).
    EndpointInUse when that cannot be told."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(0.5)
    try:
        probe.connect(os.fspath(path))
    except (ConnectionRefusedError, FileNotFoundError):
        return False
    except OSError as exc:
        raise EndpointInUse(errno.EADDRINUSE, f"cannot tell whether {path} is in use: {exc}") from None
    finally:
        probe.close()
    return True


def prepare_ipc_bind(endpoint: str) -> Path | None:
    """Before binding: private directory, and never replace a live socket.

    libzmq unlinks an existing file at the bind path, which would silently
    steal the endpoint of a daemon that is still running; a stale file left
    by a dead one is removed instead.
    """
    path = ipc_path(endpoint)
    if path is None:
        return None
    if "*" in path.name:
        raise ValueError(f"wildcard ipc endpoints cannot be made private: {endpoint}")
    if len(os.fsencode(path)) > MAX_IPC_PATH_BYTES:
        raise ValueError(f"socket path {path} is longer than {MAX_IPC_PATH_BYTES} bytes (the Unix socket limit)")
    ensure_runtime_dir(path.parent)
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return path
    if not stat.S_ISSOCK(info.st_mode):
        raise EndpointInUse(errno.EEXIST, f"{path} exists and is not a socket; refusing to replace it")
    if is_listening(path):
        raise EndpointInUse(errno.EADDRINUSE, f"another process is listening on {path}")
    path.unlink(missing_ok=True)
    return path


def finish_ipc_bind(path: Path | None) -> tuple[int, int] | None:
    """After binding: owner-only socket file. The directory is already 0700,
    so nobody else could reach the file in the moment before this chmod.
    Returns the file's (device, inode) for remove_ipc_file."""
    if path is None:
        return None
    os.chmod(path, 0o600)
    info = os.lstat(path)
    return (info.st_dev, info.st_ino)


def remove_ipc_file(path: Path | None, file_id: tuple[int, int] | None) -> None:
    """After closing: remove the socket file if it is still the one we bound.

    libzmq normally unlinks it itself, but asynchronously; checking the inode
    keeps us from deleting the socket of a daemon that bound the path since.
    """
    if path is None or file_id is None:
        return
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return
    if (info.st_dev, info.st_ino) == file_id:
        path.unlink(missing_ok=True)
