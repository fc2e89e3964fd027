"""The adapter registry: which adapters exist, persisted in SQLite under the state directory.

Owns the adapters table (base-model scope, name, path, rank, target modules,
pinned, when and by whom added, the content hash and file fingerprint last
seen, how often used) and its schema migrations; the rules an entry must follow
are daemon/adapter_rules.py's. Every registry object is
scoped to one base model (daemon/model_scope.py), so daemons serving different
models never see each other's adapters. Never reads adapter weights and never
decides residency; that is the cache manager's and the scheduler's job.
"""
from __future__ import annotations

import json
import os
import sqlite3
import stat
import time
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from loraplex.contracts.names import MAX_NAME_LEN
from loraplex.daemon.adapter_rules import (
    RegistryError,
    check_adapter_name,
    check_path_text,
    check_target_modules,
)

SOURCES: tuple[str, ...] = ("cli", "admin", "flag", "config")
DEFAULT_BUSY_TIMEOUT_S = 5.0
# Rows written before registries were scoped by base model (schema 1), or by a caller that names no
# model: claimed by the first daemon whose model they load on (daemon/model_scope.py).
UNSCOPED = ""

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
    (  # 2: one namespace per base model; the identity last seen and the use count (lazy start-up)
        """CREATE TABLE adapters_v2 (
            model TEXT NOT NULL,
            name TEXT NOT NULL,
            path TEXT NOT NULL,
            rank INTEGER,
            target_modules TEXT NOT NULL DEFAULT '[]',
            pinned INTEGER NOT NULL DEFAULT 0,
            added_at REAL NOT NULL,
            source TEXT NOT NULL,
            content_hash TEXT NOT NULL DEFAULT '',
            fingerprint TEXT NOT NULL DEFAULT '',
            uses INTEGER NOT NULL DEFAULT 0,
            PRIMARY KEY (model, name)
        )""",
        """INSERT INTO adapters_v2 (model, name, path, rank, target_modules, pinned, added_at, source)
           SELECT '', name, path, rank, target_modules, pinned, added_at, source FROM adapters""",
        "DROP TABLE adapters",
        "ALTER TABLE adapters_v2 RENAME TO adapters",
    ),
)
SCHEMA_VERSION = len(MIGRATIONS)
# A replace that brings no identity (a --adapter flag at every start) keeps the one recorded for
# the same path, so the daemon need not hash unchanged files again.
_KEEP_IDENTITY = ("CASE WHEN excluded.{column} != '' THEN excluded.{column} "
                  "WHEN adapters.path = excluded.path THEN adapters.{column} ELSE '' END")
_COLUMNS = "name, path, rank, target_modules, pinned, added_at, source, content_hash, fingerprint, uses"
_INSERT = ("INSERT INTO adapters (model, name, path, rank, target_modules, added_at, source, content_hash, "
           "fingerprint) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)")


class RegistrySchemaError(RuntimeError):
    """The database was written by a newer loraplex (schema version above SCHEMA_VERSION)."""


@dataclass(frozen=True, slots=True)
class AdapterRecord:
    """One registered adapter as stored; rank None = not yet known (read at load time).
    content_hash and fingerprint: what the daemon last read (daemon/adapter_hash.py), '' = never;
    uses: requests served with it over past runs (the background warm-up goes most used first)."""

    name: str
    path: str
    rank: int | None
    target_modules: tuple[str, ...]
    pinned: bool
    added_at: float
    source: str
    content_hash: str = ""
    fingerprint: str = ""
    uses: int = 0

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
    same time; writers wait up to `busy_timeout_s` for each other. `model` is the
    base-model scope every query and change is confined to (UNSCOPED: the rows no
    daemon has claimed yet).
    """

    def __init__(self, db_path: str | os.PathLike[str], *, model: str = UNSCOPED,
                 busy_timeout_s: float = DEFAULT_BUSY_TIMEOUT_S) -> None:
        if not isinstance(model, str) or len(model) > MAX_NAME_LEN:
            raise ValueError(f"registry model scope must be a string of at most {MAX_NAME_LEN} chars, got {model!r}")
        self.db_path = Path(db_path)
        self.model = model
        ensure_state_dir(self.db_path.parent)
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
        return self._get(self._db, name)

    def list(self) -> list[AdapterRecord]:
        """Every adapter of this model, sorted by name."""
        return [_record(row) for row in self._db.execute(
            f"SELECT {_COLUMNS} FROM adapters WHERE model = ? ORDER BY name", (self.model,))]

    def unscoped(self) -> list[AdapterRecord]:
        """The rows no model has claimed yet (see UNSCOPED), sorted by name; [] for the unscoped view."""
        if self.model == UNSCOPED:
            return []
        return [_record(row) for row in self._db.execute(
            f"SELECT {_COLUMNS} FROM adapters WHERE model = ? ORDER BY name", (UNSCOPED,))]

    def count_other_models(self) -> int:
        """Adapters registered under other scopes (unclaimed ones included): what this model does not see."""
        return int(self._db.execute("SELECT COUNT(*) FROM adapters WHERE model != ?", (self.model,)).fetchone()[0])

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
        content_hash: str = "",
        fingerprint: str = "",
    ) -> AdapterRecord:
        """Register `name` at absolute `path`; with replace=True an existing entry is
        overwritten (keeping its pin and use count), otherwise RegistryError("already_exists")."""
        check_adapter_name(name)
        path_str = check_path_text(path)
        if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int) or rank <= 0):
            raise RegistryError("invalid_field", f"adapter rank must be a positive integer or None, got {rank!r}")
        modules = check_target_modules(target_modules)
        if source not in SOURCES:
            raise RegistryError("invalid_field", f"adapter source must be one of {', '.join(SOURCES)}, got {source!r}")
        row = (self.model, name, path_str, rank, json.dumps(list(modules)), time.time(), source, str(content_hash),
               str(fingerprint))
        with self._transaction() as db:
            if replace:
                db.execute(
                    f"{_INSERT} ON CONFLICT (model, name) DO UPDATE SET path = excluded.path, rank = excluded.rank, "
                    "target_modules = excluded.target_modules, added_at = excluded.added_at, source = excluded.source, "
                    f"content_hash = {_KEEP_IDENTITY.format(column='content_hash')}, "
                    f"fingerprint = {_KEEP_IDENTITY.format(column='fingerprint')}",
                    row,
                )
            else:
                try:
                    db.execute(_INSERT, row)
                except sqlite3.IntegrityError:
                    raise RegistryError("already_exists", f"adapter {name!r} is already registered") from None
            stored = self._get(db, name)
        return stored  # type: ignore[return-value]

    def remove(self, name: str, *, missing_ok: bool = False) -> bool:
        """Unregister `name`; True if it was registered. A missing name raises
        RegistryError("not_found") unless missing_ok, which returns False."""
        with self._transaction() as db:
            removed = db.execute("DELETE FROM adapters WHERE model = ? AND name = ?", (self.model, name)).rowcount > 0
        if not removed and not missing_ok:
            raise RegistryError("not_found", f"adapter {name!r} is not registered")
        return removed

    def set_pinned(self, name: str, pinned: bool) -> AdapterRecord:
        """Pin or unpin `name`; RegistryError("not_found") if it is not registered."""
        with self._transaction() as db:
            db.execute("UPDATE adapters SET pinned = ? WHERE model = ? AND name = ?",
                       (int(bool(pinned)), self.model, name))
            record = self._get(db, name)
        if record is None:
            raise RegistryError("not_found", f"adapter {name!r} is not registered")
        return record

    def record_identity(self, name: str, content_hash: str, fingerprint: str) -> None:
        """What the daemon read of `name`'s files (a no-op for a name not registered here)."""
        with self._transaction() as db:
            db.execute("UPDATE adapters SET content_hash = ?, fingerprint = ? WHERE model = ? AND name = ?",
                       (content_hash, fingerprint, self.model, name))

    def add_uses(self, counts: Mapping[str, int]) -> None:
        """Add requests served per adapter (at the daemon's stop) to the stored use counts."""
        rows = [(int(n), self.model, name) for name, n in counts.items() if n > 0]
        if rows:
            with self._transaction() as db:
                db.executemany("UPDATE adapters SET uses = uses + ? WHERE model = ? AND name = ?", rows)

    def restore(self, record: AdapterRecord) -> None:
        """Put `record` back as it was (every field), in this model's scope: undoes a change the
        serving core then refused (daemon/adapter_changes.py)."""
        with self._transaction() as db:
            db.execute(
                "INSERT OR REPLACE INTO adapters (model, name, path, rank, target_modules, pinned, added_at, source, "
                "content_hash, fingerprint, uses) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (self.model, record.name, record.path, record.rank, json.dumps(list(record.target_modules)),
                 int(record.pinned), record.added_at, record.source, record.content_hash, record.fingerprint,
                 record.uses),
            )

    def claim(self, name: str) -> AdapterRecord | None:
        """Move the unscoped row `name` into this model's scope; None if there is none, or this
        model already has an adapter of that name (the unscoped row then stays for another)."""
        if self.model == UNSCOPED:
            return None
        with self._transaction() as db:
            if self._get(db, name) is not None:
                return None
            db.execute("UPDATE adapters SET model = ? WHERE model = ? AND name = ?", (self.model, UNSCOPED, name))
            return self._get(db, name)

    # ---- internals --------------------------------------------------------------------------
    def _get(self, db: sqlite3.Connection, name: str) -> AdapterRecord | None:
        row = db.execute(f"SELECT {_COLUMNS} FROM adapters WHERE model = ? AND name = ?", (self.model, name)).fetchone()
        return None if row is None else _record(row)

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
    name, path, rank, modules, pinned, added_at, source, content_hash, fingerprint, uses = row
    return AdapterRecord(
        name=str(name),
        path=str(path),
        rank=None if rank is None else int(rank),  # type: ignore[call-overload]
        target_modules=tuple(json.loads(str(modules))),
        pinned=bool(pinned),
        added_at=float(added_at),  # type: ignore[arg-type]
        source=str(source),
        content_hash=str(content_hash),
        fingerprint=str(fingerprint),
        uses=int(uses),  # type: ignore[call-overload]
    )


def ensure_state_dir(path: Path) -> None:
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
