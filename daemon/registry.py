"""The adapter registry: which adapters exist, persisted in SQLite under the state directory.

Owns the adapters table (name, path, rank, target modules, pinned, when and by
whom added), its schema migrations, adapter name rules and the check that an
adapter path stays inside the allowed roots. Never reads adapter weights and
never decides residency; that is the cache manager's and the scheduler's job.
"""
from __future__ import annotations

import json
import os
import re
import sqlite3
import stat
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

MAX_NAME_LEN = 128
MAX_PATH_LEN = 4096
_NAME = re.compile(r"[A-Za-z0-9._-]{1,%d}" % MAX_NAME_LEN)
SOURCES: tuple[str, ...] = ("cli", "admin", "flag", "config")
ERROR_CODES: tuple[str, ...] = ("already_exists", "not_found", "invalid_field", "forbidden_path")
DEFAULT_BUSY_TIMEOUT_S = 5.0

# Schema migrations: entry i takes the database from version i to version i + 1.
# Only ever append; a released migration is never edited.
MIGRATIONS: tuple[tuple[str, ...], ...] = (
    (
        """CREATE TABLE adapters (
            name TEXT PRIMARY KEY,
            path TEXT NOT NULL,
            rank INTEGER,
            target_modules TEXT NOT NULL DEFAULT '[]',
            pinned INTEGER NOT NULL DEFAULT 0,
            added_at REAL NOT NULL,
            source TEXT NOT NULL
        )""",
    ),
)
SCHEMA_VERSION = len(MIGRATIONS)
_COLUMNS = "name, path, rank, target_modules, pinned, added_at, source"
_INSERT = "INSERT INTO adapters (name, path, rank, target_modules, added_at, source) VALUES (?, ?, ?, ?, ?, ?)"


class RegistryError(ValueError):
    """A registry operation was refused; `code` is one of ERROR_CODES (the wire error codes)."""

    def __init__(self, code: str, message: str) -> None:
        if code not in ERROR_CODES:
            raise ValueError(f"unknown registry error code {code!r}")
        super().__init__(message)
        self.code = code


class RegistrySchemaError(RuntimeError):
    """The database was written by a newer loraplex (schema version above SCHEMA_VERSION)."""


def is_valid_adapter_name(name: object) -> bool:
    """1..128 chars of [A-Za-z0-9._-], not '.' or '..' (the wire protocol's name rule)."""
    return isinstance(name, str) and bool(_NAME.fullmatch(name)) and name not in (".", "..")


def check_adapter_name(name: object) -> str:
    if not is_valid_adapter_name(name):
        shown = name[:64] if isinstance(name, str) else name
        raise RegistryError(
            "invalid_field",
            f"adapter name must be 1..{MAX_NAME_LEN} chars of [A-Za-z0-9._-] (not '.' or '..'), got {shown!r}",
        )
    return name  # type: ignore[return-value]


def check_adapter_path(path: str | os.PathLike[str], allowed_roots: tuple[str, ...] = ()) -> Path:
    """The adapter directory `path` with symlinks resolved, if it is allowed.

    Refuses (RegistryError) a relative or missing path, a non-directory
    (invalid_field) and, when `allowed_roots` is non-empty, a path whose resolved
    location is outside every resolved root (forbidden_path), so a symlink cannot
    escape the roots. Callers should store and load the returned path, not `path`.
    """
    raw = os.fspath(path)
    if not raw or "\x00" in raw or not os.path.isabs(raw):
        raise RegistryError("invalid_field", f"adapter path must be an absolute path, got {raw[:256]!r}")
    try:
        resolved = Path(raw).resolve(strict=True)
    except FileNotFoundError:
        raise RegistryError("invalid_field", f"adapter path {raw} does not exist") from None
    except (OSError, RuntimeError) as exc:  # RuntimeError: symlink loop on older Pythons
        raise RegistryError("invalid_field", f"adapter path {raw} cannot be resolved: {exc}") from None
    if allowed_roots:
        roots = [Path(root).expanduser().resolve() for root in allowed_roots]
        if not any(resolved == root or resolved.is_relative_to(root) for root in roots):
            via = "" if str(resolved) == raw else f" (resolves to {resolved})"
            raise RegistryError(
                "forbidden_path",
                f"adapter path {raw}{via} is outside the allowed adapter directories: {', '.join(map(str, roots))}",
            )
    if not resolved.is_dir():
        raise RegistryError("invalid_field", f"adapter path {raw} is not a directory")
    return resolved


@dataclass(frozen=True, slots=True)
class AdapterRecord:
    """One registered adapter as stored; rank None = not yet known (read at load time)."""

    name: str
    path: str
    rank: int | None
    target_modules: tuple[str, ...]
    pinned: bool
    added_at: float
    source: str

    def to_dict(self) -> dict[str, object]:
        return {
            "name": self.name,
            "path": self.path,
            "rank": self.rank,
            "target_modules": list(self.target_modules),
            "pinned": self.pinned,
            "added_at": self.added_at,
            "source": self.source,
        }


class AdapterRegistry:
    """Adapters by name in one SQLite file (WAL), shared safely with other processes.

    Meant for one thread (the daemon's event loop): every call is one short
    transaction. Another process (an admin CLI) may open the same file at the
    same time; writers wait up to `busy_timeout_s` for each other.
    """

    def __init__(self, db_path: str | os.PathLike[str], *, busy_timeout_s: float = DEFAULT_BUSY_TIMEOUT_S) -> None:
        self.db_path = Path(db_path)
        _ensure_private_dir(self.db_path.parent)
        _precreate_private_file(self.db_path)
        self._conn: sqlite3.Connection | None = sqlite3.connect(
            self.db_path, timeout=busy_timeout_s, isolation_level=None
        )
        try:
            self._conn.execute(f"PRAGMA busy_timeout = {int(busy_timeout_s * 1000)}")
            mode = self._conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
            if str(mode).lower() != "wal":
                raise OSError(
                    f"adapter registry {self.db_path}: the filesystem does not support SQLite WAL mode ({mode})"
                )
            self._migrate()
        except BaseException:
            self.close()
            raise

    # ---- lifecycle --------------------------------------------------------------------------
    def close(self) -> None:
        """Close the connection; further calls raise RuntimeError. Idempotent."""
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def __enter__(self) -> AdapterRegistry:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def schema_version(self) -> int:
        return int(self._db.execute("SELECT version FROM schema_version").fetchone()[0])

    # ---- queries ----------------------------------------------------------------------------
    def get(self, name: str) -> AdapterRecord | None:
        row = self._db.execute(f"SELECT {_COLUMNS} FROM adapters WHERE name = ?", (name,)).fetchone()
        return None if row is None else _record(row)

    def list(self) -> list[AdapterRecord]:
        """Every adapter, sorted by name."""
        return [_record(row) for row in self._db.execute(f"SELECT {_COLUMNS} FROM adapters ORDER BY name")]

    # ---- changes ----------------------------------------------------------------------------
    def add(
        self,
        name: str,
        path: str | os.PathLike[str],
        *,
        rank: int | None = None,
        target_modules: Iterable[str] = (),
        source: str = "admin",
        replace: bool = False,
    ) -> AdapterRecord:
        """Register `name` at absolute `path`; with replace=True an existing entry is
        overwritten (keeping its pin), otherwise RegistryError("already_exists")."""
        check_adapter_name(name)
        path_str = _check_path(path)
        if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int) or rank <= 0):
            raise RegistryError("invalid_field", f"adapter rank must be a positive integer or None, got {rank!r}")
        modules = _check_modules(target_modules)
        if source not in SOURCES:
            raise RegistryError("invalid_field", f"adapter source must be one of {', '.join(SOURCES)}, got {source!r}")
        row = (name, path_str, rank, json.dumps(list(modules)), time.time(), source)
        with self._transaction() as db:
            if replace:
                db.execute(
                    f"{_INSERT} ON CONFLICT (name) DO UPDATE SET path = excluded.path, rank = excluded.rank, "
                    "target_modules = excluded.target_modules, added_at = excluded.added_at, source = excluded.source",
                    row,
                )
            else:
                try:
                    db.execute(_INSERT, row)
                except sqlite3.IntegrityError:
                    raise RegistryError("already_exists", f"adapter {name!r} is already registered") from None
            stored = db.execute(f"SELECT {_COLUMNS} FROM adapters WHERE name = ?", (name,)).fetchone()
        return _record(stored)

    def remove(self, name: str, *, missing_ok: bool = False) -> bool:
        """Unregister `name`; True if it was registered. A missing name raises
        RegistryError("not_found") unless missing_ok, which returns False."""
        with self._transaction() as db:
            removed = db.execute("DELETE FROM adapters WHERE name = ?", (name,)).rowcount > 0
        if not removed and not missing_ok:
            raise RegistryError("not_found", f"adapter {name!r} is not registered")
        return removed

    def set_pinned(self, name: str, pinned: bool) -> AdapterRecord:
        """Pin or unpin `name`; RegistryError("not_found") if it is not registered."""
        with self._transaction() as db:
            db.execute("UPDATE adapters SET pinned = ? WHERE name = ?", (int(bool(pinned)), name))
            row = db.execute(f"SELECT {_COLUMNS} FROM adapters WHERE name = ?", (name,)).fetchone()
        if row is None:
            raise RegistryError("not_found", f"adapter {name!r} is not registered")
        return _record(row)

    # ---- internals --------------------------------------------------------------------------
    @property
    def _db(self) -> sqlite3.Connection:
        if self._conn is None:
            raise RuntimeError(f"adapter registry {self.db_path} is closed")
        return self._conn

    @contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        """BEGIN IMMEDIATE (take the write lock up front, so concurrent writers wait
        on busy_timeout instead of failing on lock upgrade) ... COMMIT or ROLLBACK."""
        db = self._db
        db.execute("BEGIN IMMEDIATE")
        try:
            yield db
        except BaseException:
            db.execute("ROLLBACK")
            raise
        db.execute("COMMIT")

    def _migrate(self) -> None:
        with self._transaction() as db:
            db.execute("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL)")
            row = db.execute("SELECT version FROM schema_version").fetchone()
            current = 0 if row is None else int(row[0])
            if current > SCHEMA_VERSION:
                raise RegistrySchemaError(
                    f"adapter registry {self.db_path} has schema version {current}, newer than this loraplex "
                    f"understands ({SCHEMA_VERSION}); upgrade loraplex or use another state directory"
                )
            for statements in MIGRATIONS[current:]:
                for statement in statements:
                    db.execute(statement)
            if row is None:
                db.execute("INSERT INTO schema_version (version) VALUES (?)", (SCHEMA_VERSION,))
            elif current != SCHEMA_VERSION:
                db.execute("UPDATE schema_version SET version = ?", (SCHEMA_VERSION,))


def _record(row: tuple[object, ...]) -> AdapterRecord:
    name, path, rank, modules, pinned, added_at, source = row
    return AdapterRecord(
        name=str(name),
        path=str(path),
        rank=None if rank is None else int(rank),  # type: ignore[call-overload]
        target_modules=tuple(json.loads(str(modules))),
        pinned=bool(pinned),
        added_at=float(added_at),  # type: ignore[arg-type]
        source=str(source),
    )


def _check_path(path: str | os.PathLike[str]) -> str:
    raw = os.fspath(path)
    if not isinstance(raw, str) or not 1 <= len(raw) <= MAX_PATH_LEN or "\x00" in raw:
        raise RegistryError("invalid_field", f"adapter path must be 1..{MAX_PATH_LEN} characters without NUL")
    if not os.path.isabs(raw):
        raise RegistryError(
            "invalid_field", f"adapter path must be absolute (the daemon's working directory is not yours), got {raw!r}"
        )
    return raw


def _check_modules(target_modules: Iterable[str]) -> tuple[str, ...]:
    if isinstance(target_modules, str):
        raise RegistryError("invalid_field", "target_modules must be a sequence of module names, not one string")
    modules = tuple(target_modules)
    if not all(isinstance(m, str) and m for m in modules):
        raise RegistryError("invalid_field", f"target_modules must be non-empty strings, got {modules!r}")
    return modules


def _ensure_private_dir(path: Path) -> None:
    """Create the state directory 0700 if missing; refuse one that others could write into
    (they could then point adapter names at files of their choosing)."""
    if not path.exists():
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(path, 0o700)  # the umask may have narrowed the owner's own bits
    info = os.stat(path)
    if not stat.S_ISDIR(info.st_mode):
        raise NotADirectoryError(f"state directory {path} exists and is not a directory")
    if info.st_uid != os.geteuid():
        raise PermissionError(f"state directory {path} is owned by uid {info.st_uid}, not by us (uid {os.geteuid()})")
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise PermissionError(
            f"state directory {path} is writable by group or others (mode {stat.S_IMODE(info.st_mode):o}); "
            "fix it with chmod 700 or choose another directory"
        )


def _precreate_private_file(path: Path) -> None:
    """Create the database file 0600 before SQLite does (SQLite would use the umask;
    its -wal and -shm files copy the database file's mode)."""
    fd = os.open(path, os.O_CREAT | os.O_RDWR | getattr(os, "O_NOFOLLOW", 0), 0o600)
    os.close(fd)
