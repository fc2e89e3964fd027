"""Where a daemon's sockets live, and the checks that keep them private.

Owns the choice of runtime directory, its ownership/permission checks, the
ipc:// endpoint paths derived from it and the instance id that shared-memory
names derive from, so two daemons on one host never collide. Never opens
sockets and never loosens permissions.
"""
from __future__ import annotations

import hashlib
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path

ENV_RUNTIME_DIR = "LORAPLEX_RUNTIME_DIR"
# sockaddr_un.sun_path is 108 bytes on Linux, including the trailing NUL.
MAX_IPC_PATH_BYTES = 107
_ENDPOINT_NAME = re.compile(r"[a-z][a-z0-9_-]{0,31}")
# A runtime directory its group may enter but not list (server.admin_group).
GROUP_ENTER_MODE = 0o710


class RuntimeDirError(PermissionError):
    """The runtime directory is unsafe (foreign owner, writable by others, a
    symlink, not a directory) or cannot be created."""


def default_runtime_dir() -> Path:
    """$LORAPLEX_RUNTIME_DIR, else $XDG_RUNTIME_DIR/loraplex, else /tmp/loraplex-<uid>."""
    explicit = os.environ.get(ENV_RUNTIME_DIR)
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg:
        return Path(xdg) / "loraplex"
    return Path("/tmp") / f"loraplex-{os.getuid()}"


def ensure_runtime_dir(path: str | os.PathLike[str]) -> Path:
    """Create `path` with mode 0700 if missing, then check it is safe to use.

    Refuses (RuntimeDirError) a symlink, a non-directory, a directory owned by
    another user, or one that group or others can write: anyone who can write
    there could replace our socket files with their own. A directory we own
    that others can merely read or enter is tightened to 0700, except 0710:
    the daemon opens it so to server.admin_group (its members may enter, not
    list; each socket file's own mode decides who may connect).
    """
    target = Path(path)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        target.mkdir(mode=0o700)
    except FileExistsError:
        pass
    except OSError as exc:
        raise RuntimeDirError(f"cannot create runtime directory {target}: {exc.strerror}") from None
    try:
        info = os.lstat(target)
    except OSError as exc:
        raise RuntimeDirError(f"cannot inspect runtime directory {target}: {exc.strerror}") from None
    if stat.S_ISLNK(info.st_mode):
        raise RuntimeDirError(f"runtime directory {target} is a symlink; refusing to follow it")
    if not stat.S_ISDIR(info.st_mode):
        raise RuntimeDirError(f"runtime directory {target} exists and is not a directory")
    if info.st_uid != os.getuid():
        raise RuntimeDirError(
            f"runtime directory {target} is owned by uid {info.st_uid}, not by us (uid {os.getuid()})"
        )
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise RuntimeDirError(
            f"runtime directory {target} is writable by group or others (mode {stat.S_IMODE(info.st_mode):o}); "
            "fix it with chmod 700 or choose another directory"
        )
    if stat.S_IMODE(info.st_mode) not in (0o700, GROUP_ENTER_MODE):
        os.chmod(target, 0o700)
    return target


def ipc_endpoint(runtime_dir: str | os.PathLike[str], name: str) -> str:
    """The ipc:// endpoint `<runtime_dir>/<name>.sock`; ValueError if the
    name is not a short lowercase identifier or the path is too long for a
    Unix socket."""
    if not _ENDPOINT_NAME.fullmatch(name):
        raise ValueError(f"endpoint name must match {_ENDPOINT_NAME.pattern}, got {name!r}")
    path = Path(runtime_dir) / f"{name}.sock"
    if len(os.fsencode(path)) > MAX_IPC_PATH_BYTES:
        raise ValueError(
            f"socket path {path} is longer than {MAX_IPC_PATH_BYTES} bytes (the Unix socket limit); "
            f"use a shorter runtime directory (${ENV_RUNTIME_DIR})"
        )
    return f"ipc://{path}"


def instance_id(runtime_dir: str | os.PathLike[str]) -> str:
    """A short stable id for the daemon owning `runtime_dir` (12 hex chars).

    Derived from the absolute directory path and the uid, so a daemon that
    restarts finds (and can clean up) its previous shared-memory segments,
    while daemons with different runtime directories never share a name.
    """
    key = f"{os.getuid()}:{os.path.abspath(os.fspath(runtime_dir))}"
    return hashlib.blake2s(key.encode(), digest_size=6).hexdigest()


@dataclass(frozen=True, slots=True)
class Endpoints:
    """The daemon's public endpoints and the id its private names derive from."""

    client: str
    admin: str
    stats: str
    instance_id: str

    @property
    def socket_paths(self) -> tuple[Path, ...]:
        """Filesystem paths of the socket files (for cleanup and checks)."""
        return tuple(Path(e[len("ipc://"):]) for e in (self.client, self.admin, self.stats))


def endpoints(runtime_dir: str | os.PathLike[str]) -> Endpoints:
    """client.sock, admin.sock and stats.sock inside `runtime_dir`."""
    return Endpoints(
        client=ipc_endpoint(runtime_dir, "client"),
        admin=ipc_endpoint(runtime_dir, "admin"),
        stats=ipc_endpoint(runtime_dir, "stats"),
        instance_id=instance_id(runtime_dir),
    )
