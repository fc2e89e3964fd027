"""One daemon per base model per state directory, and no repair under a running daemon: flocks on
files in the state directory, taken before the registry is opened and held for the daemon's whole
life. The kernel drops them when the process ends, however it ends (no stale lock after a SIGKILL).

A daemon holds `daemon.lock` shared (daemons of different base models may share one directory:
the registry keeps their adapters apart, daemon/model_scope.py) and `daemon-<scope>.lock`
exclusive, with its pid written there so a second daemon of that model can say whom it ran into.
`loraplex registry repair` holds `daemon.lock` exclusive (its pid written there): no daemon starts
while the file is rewritten, and none may be running. Stdlib only; never deletes a lock file
(one unlinked while others open it stops excluding anyone).
"""
from __future__ import annotations

import fcntl
import hashlib
import os
import re
from pathlib import Path

DIR_LOCK = "daemon.lock"
_SAFE = re.compile(r"[A-Za-z0-9._-]{1,128}")
_PID_BYTES = 32  # a pid and a newline, with room to spare


class StateDirLocked(OSError):
    """The lock is held elsewhere; `pid` is the holder's when known. str(): the one-line reason."""

    def __init__(self, message: str, pid: int | None) -> None:
        super().__init__(message)  # no errno: str() is the sentence alone
        self.pid = pid


def scope_lock_name(scope: str) -> str:
    """The lock file of one base model's daemon (a hash stands in for a scope unfit for a file name)."""
    safe = scope if _SAFE.fullmatch(scope) and scope not in (".", "..") else \
        hashlib.sha256(scope.encode()).hexdigest()[:16]
    return f"daemon-{safe}.lock"


class StateLock:
    """The held locks; `release()` (or process exit) lets the next one in."""

    def __init__(self, fds: list[int]) -> None:
        self._fds = fds

    @classmethod
    def for_daemon(cls, state_dir: Path, scope: str) -> StateLock:
        """A daemon of base model `scope` on `state_dir` (which must exist), without waiting."""
        shared = _open(state_dir / DIR_LOCK)
        if not _try(shared, fcntl.LOCK_SH):
            pid = _read_pid(shared)
            os.close(shared)
            raise StateDirLocked(f"state directory {state_dir} is being repaired ({_who(pid)}); start the daemon "
                                 "once `loraplex registry repair` is done", pid)
        try:
            own = _open(state_dir / scope_lock_name(scope))
        except BaseException:
            os.close(shared)
            raise
        if not _try(own, fcntl.LOCK_EX):
            pid = _read_pid(own)
            os.close(own)
            os.close(shared)
            raise StateDirLocked(f"state directory {state_dir} is in use by another loraplex daemon serving this "
                                 f"base model ({_who(pid)}); stop it first, or give this one another --state-dir",
                                 pid)
        _write_pid(own)
        return cls([own, shared])

    @classmethod
    def exclusive(cls, state_dir: Path) -> StateLock:
        """The whole directory (a registry repair): refused while any daemon holds it."""
        fd = _open(state_dir / DIR_LOCK)
        if not _try(fd, fcntl.LOCK_EX):
            os.close(fd)
            pid = _a_daemon(state_dir)
            raise StateDirLocked(f"state directory {state_dir} is in use by a loraplex daemon ({_who(pid)}); "
                                 "stop it first", pid)
        _write_pid(fd)
        return cls([fd])

    @property
    def held(self) -> bool:
        return bool(self._fds)

    def release(self) -> None:
        """Let go (idempotent). The files stay; a pid in one is read only while it is locked."""
        while self._fds:
            os.close(self._fds.pop())

    def __enter__(self) -> StateLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _open(path: Path) -> int:
    # O_CLOEXEC (os.open's default): no child inherits a lock and outlives us holding it.
    return os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o600)


def _try(fd: int, kind: int) -> bool:
    """Whether the lock was taken; OSError (ENOLCK, say) passes."""
    try:
        fcntl.flock(fd, kind | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _write_pid(fd: int) -> None:
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)


def _read_pid(fd: int) -> int | None:
    try:
        text = os.pread(fd, _PID_BYTES, 0).decode("ascii", "replace").strip()
    except OSError:
        return None
    return int(text) if text.isdigit() and int(text) > 0 else None


def _a_daemon(state_dir: Path) -> int | None:
    """For the message only: the pid recorded by a daemon's lock file whose process still runs."""
    for path in sorted(state_dir.glob("daemon-*.lock")):
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        except OSError:
            continue
        pid = _read_pid(fd)
        os.close(fd)
        if pid is not None and os.path.exists(f"/proc/{pid}"):
            return pid
    return None


def _who(pid: int | None) -> str:
    return f"pid {pid}" if pid is not None else "pid unknown"
