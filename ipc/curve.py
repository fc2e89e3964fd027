"""CURVE encryption and a client-key allow-list for tcp:// endpoints.

Owns the key files (one z85 key per line, `# ` comment lines; a secret key file
must be private to its owner), loading and checking them with clear errors, the
CURVE options of a server or client socket, and the asyncio ZAP authenticator
that admits only listed client public keys. ipc:// endpoints never use CURVE
(filesystem permissions guard them). Never logs, prints or reprs a secret key.
"""
from __future__ import annotations

import logging
import os
import re
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio
from zmq.auth.asyncio import AsyncioAuthenticator

log = logging.getLogger("loraplex.ipc.curve")

ZAP_DOMAIN = b"loraplex"
SECRET_SUFFIX = ".key"
PUBLIC_SUFFIX = ".pub"
_Z85_KEY = re.compile(r"[0-9a-zA-Z.\-:+=^!/*?&<>()\[\]{}@%$#]{40}")
# A client whose key is refused retries every reconnect interval: log each key once a minute at most.
_DENIED_LOG_INTERVAL_S = 60.0
_DENIED_LOG_KEYS = 1024


class CurveError(ValueError):
    """A CURVE key file is missing, malformed or readable by others, or CURVE is unavailable."""


def _require_curve() -> None:
    if not zmq.has("curve"):
        raise CurveError(f"this libzmq ({zmq.zmq_version()}) was built without CURVE support")


def _keys_in(path: Path, what: str) -> list[bytes]:
    """The z85 keys of one file: every line that is not blank or a `# ` comment."""
    try:
        text = path.read_text(encoding="ascii")
    except FileNotFoundError:
        raise CurveError(f"{what} {path} does not exist") from None
    except UnicodeDecodeError:
        raise CurveError(f"{what} {path} is not a text file of z85 keys") from None
    except OSError as exc:
        raise CurveError(f"cannot read {what} {path}: {exc.strerror}") from None
    keys = []
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line == "#" or line.startswith("# "):
            continue
        if not _Z85_KEY.fullmatch(line):
            raise CurveError(f"{what} {path}, line {number}: not a CURVE key (expected 40 z85 characters)")
        keys.append(line.encode())
    return keys


def read_secret_key(path: str | os.PathLike[str], what: str = "CURVE secret key file") -> tuple[bytes, bytes]:
    """(public, secret) z85 keys from a secret key file, which must be a regular
    file holding one key and readable by its owner only (like ssh's keys)."""
    _require_curve()
    path = Path(path)
    try:
        info = path.stat()
    except FileNotFoundError:
        raise CurveError(f"{what} {path} does not exist") from None
    except OSError as exc:
        raise CurveError(f"cannot read {what} {path}: {exc.strerror}") from None
    if not stat.S_ISREG(info.st_mode):
        raise CurveError(f"{what} {path} is not a regular file")
    if info.st_mode & 0o077:
        raise CurveError(f"{what} {path} is accessible to other users (mode {stat.S_IMODE(info.st_mode):04o}); "
                         f"run: chmod 600 {path}")
    keys = _keys_in(path, what)
    if len(keys) != 1:
        raise CurveError(f"{what} {path} must hold exactly one key, found {len(keys)}")
    return zmq.curve_public(keys[0]), keys[0]


def read_public_key(path: str | os.PathLike[str], what: str = "CURVE public key file") -> bytes:
    """The one z85 public key of a `.pub` file."""
    keys = _keys_in(Path(path), what)
    if len(keys) != 1:
        raise CurveError(f"{what} {path} must hold exactly one key, found {len(keys)}")
    return keys[0]


def read_allowed_keys(path: str | os.PathLike[str]) -> frozenset[bytes]:
    """Client public keys from a file (one per line) or a directory (every `*.pub` file in it)."""
    what = "CURVE allowed-keys"
    path = Path(path)
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.name.endswith(PUBLIC_SUFFIX) and p.is_file())
        if not files:
            raise CurveError(f"{what} directory {path} has no *{PUBLIC_SUFFIX} files: no client could connect")
    elif path.exists():
        files = [path]
    else:
        raise CurveError(f"{what} file or directory {path} does not exist")
    keys = frozenset(k for f in files for k in _keys_in(f, f"{what} file"))
    if not keys:
        raise CurveError(f"{what} {path} lists no public keys: no client could connect")
    return keys


def generate_key_pair(directory: str | os.PathLike[str], name: str) -> tuple[Path, Path]:
    """Write NAME.key (secret, mode 0600) and NAME.pub (public) into `directory`;
    refuses to overwrite either. Returns (public path, secret path)."""
    _require_curve()
    if not name or "/" in name or name.startswith("."):
        raise CurveError(f"key name must be a plain file name, got {name!r}")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    public, secret = zmq.curve_keypair()
    pub_path, key_path = directory / f"{name}{PUBLIC_SUFFIX}", directory / f"{name}{SECRET_SUFFIX}"
    for path in (pub_path, key_path):
        if path.exists():
            raise CurveError(f"{path} already exists; remove it or choose another --name")
    fd = os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w", encoding="ascii") as fh:
        fh.write(f"# loraplex CURVE secret key; keep private. Public key: {public.decode()}\n{secret.decode()}\n")
    fd = os.open(pub_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    with os.fdopen(fd, "w", encoding="ascii") as fh:
        fh.write(f"# loraplex CURVE public key\n{public.decode()}\n")
    return pub_path, key_path


@dataclass(frozen=True, slots=True)
class CurveServerKeys:
    """A CURVE server: its key pair and the z85 public keys of the clients it admits."""

    public_key: bytes
    secret_key: bytes = field(repr=False)
    allowed: frozenset[bytes] = field(repr=False)

    @classmethod
    def from_files(cls, secret_key_file: str | os.PathLike[str],
                   allowed_keys: str | os.PathLike[str]) -> CurveServerKeys:
        public, secret = read_secret_key(secret_key_file, "CURVE server secret key file")
        return cls(public, secret, read_allowed_keys(allowed_keys))

    def apply(self, sock: zmq.Socket, endpoint: str) -> None:
        """Make `sock` a CURVE server that asks ZAP, and refuses everyone when no ZAP handler runs."""
        check_tcp_endpoint(endpoint)
        sock.setsockopt(zmq.CURVE_SERVER, 1)
        sock.setsockopt(zmq.CURVE_SECRETKEY, self.secret_key)
        sock.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN)
        sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)


@dataclass(frozen=True, slots=True)
class CurveClientKeys:
    """A CURVE client: the server's public key and the client's own key pair (all z85)."""

    server_public_key: bytes
    public_key: bytes
    secret_key: bytes = field(repr=False)

    @classmethod
    def from_files(cls, server_key_file: str | os.PathLike[str],
                   client_key_file: str | os.PathLike[str]) -> CurveClientKeys:
        """server_key_file: the server's `.pub`; client_key_file: this client's secret `.key`."""
        server = read_public_key(server_key_file, "CURVE server public key file")
        public, secret = read_secret_key(client_key_file, "CURVE client secret key file")
        return cls(server, public, secret)

    def apply(self, sock: zmq.Socket, endpoint: str) -> None:
        check_tcp_endpoint(endpoint)
        sock.setsockopt(zmq.CURVE_SERVERKEY, self.server_public_key)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, self.public_key)
        sock.setsockopt(zmq.CURVE_SECRETKEY, self.secret_key)


CurveKeys = CurveServerKeys | CurveClientKeys


def check_tcp_endpoint(endpoint: str) -> None:
    if not endpoint.startswith("tcp://"):
        raise ValueError(f"CURVE applies to tcp:// endpoints only (ipc:// relies on file permissions), got {endpoint}")


class CurveAuthenticator:
    """ZAP handler of one zmq.asyncio.Context: admits CURVE clients whose public key is
    in `keys.allowed`. Start it (inside the running loop) before binding the server
    socket; default-NULL sockets of the same context never consult it."""

    def __init__(self, ctx: zmq.asyncio.Context, keys: CurveServerKeys) -> None:
        self._allowed = keys.allowed
        self._denied_logged: dict[bytes, float] = {}
        self._auth = AsyncioAuthenticator(ctx, log=log.getChild("zap"))
        self._auth.configure_curve_callback(ZAP_DOMAIN.decode(), self)
        self.refused = 0

    def start(self) -> CurveAuthenticator:
        self._auth.start()
        log.info("CURVE on the tcp listener: %d client keys allowed", len(self._allowed))
        return self

    def stop(self) -> None:
        self._auth.stop()

    def callback(self, domain: str, key: bytes) -> bool:
        """pyzmq's credentials-provider hook: `key` is the client's z85 public key."""
        if key in self._allowed:
            return True
        self.refused += 1
        now = time.monotonic()
        if now - self._denied_logged.get(key, -_DENIED_LOG_INTERVAL_S) >= _DENIED_LOG_INTERVAL_S:
            if len(self._denied_logged) >= _DENIED_LOG_KEYS:
                self._denied_logged.clear()
            self._denied_logged[key] = now
            log.warning("refused a CURVE client with unknown public key %s (not in the allow-list)", key.decode())
        return False


def start_authenticator(ctx: Any, keys: CurveServerKeys | None) -> CurveAuthenticator | None:
    """A started CurveAuthenticator for `keys`, or None without CURVE."""
    return None if keys is None else CurveAuthenticator(ctx, keys).start()


def load_server_keys(secret_key_file: str | None, allowed_keys: str | None) -> CurveServerKeys | None:
    """The keys of a CURVE tcp listener from its two settings; None when neither is set."""
    if secret_key_file is None and allowed_keys is None:
        return None
    if secret_key_file is None or allowed_keys is None:
        raise CurveError("CURVE needs both the server's secret key file and the allowed client keys")
    return CurveServerKeys.from_files(secret_key_file, allowed_keys)
