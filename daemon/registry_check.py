"""Is the adapter registry file sound, and the way back when it is not: `loraplex registry check`
lists what is wrong (the daemon runs the same check before it opens the file and refuses to start
on a damaged one), `loraplex registry repair` keeps the old file as a timestamped backup and writes
a new one holding every entry that could still be read and is valid.

Reads the file without changing it (no migration, no write); repair writes the new file next to
the old one, fsyncs it and renames it into place. Torch-free.
"""
from __future__ import annotations

import json
import math
import os
import sqlite3
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import quote

from loraplex.contracts.names import MAX_NAME_LEN, is_valid_name
from loraplex.daemon.adapter_rules import MAX_PATH_LEN
from loraplex.daemon.registry import MIGRATIONS, SCHEMA_VERSION, SOURCES, UNSCOPED

# Every column of the current schema, and what a row written before the column existed holds in it.
COLUMNS = ("model", "name", "path", "rank", "target_modules", "pinned", "added_at", "source", "content_hash",
           "fingerprint", "uses")
_DEFAULTS: dict[str, object] = {"model": UNSCOPED, "target_modules": "[]", "pinned": 0, "content_hash": "",
                                "fingerprint": "", "uses": 0}
_SIDE_FILES = ("-wal", "-shm")  # SQLite's: they belong to the database file and move with it
MAX_LISTED = 1000  # integrity_check lines read at most


@dataclass(slots=True)
class RegistryReport:
    """What `check_registry` found. problems: one line each, [] when the file is sound; rows: the valid
    entries (a value per COLUMNS name) in the file's order; dropped: one line per entry a repair drops."""

    path: Path
    problems: list[str] = field(default_factory=list)
    rows: list[dict[str, object]] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)
    newer_schema: bool = False  # written by a newer loraplex: not damage, and not for repair to touch

    @property
    def ok(self) -> bool:
        return not self.problems


@dataclass(frozen=True, slots=True)
class RepairResult:
    backup: Path  # the old database file, renamed (its -wal and -shm beside it, renamed alike)
    kept: int
    dropped: list[str]


def check_registry(path: Path) -> RegistryReport:
    """Check the registry file at `path` without changing it (a missing or empty file is sound: a new one)."""
    report = RegistryReport(path)
    if not path.exists() or (path.stat().st_size == 0 and not path.with_name(path.name + "-wal").exists()):
        return report
    try:
        db = sqlite3.connect(f"file:{quote(str(path.absolute()))}?mode=ro", uri=True, isolation_level=None)
    except sqlite3.Error as exc:
        report.problems.append(f"cannot open: {exc}")
        report.dropped.append("every entry: the file cannot be opened")
        return report
    try:
        _check(db, report)
    except sqlite3.Error as exc:  # "file is not a database", "database disk image is malformed"
        report.problems.append(f"unreadable: {exc}")
        if not report.rows:
            report.dropped.append(f"every entry: the file is unreadable ({exc})")
    finally:
        db.close()
    return report


def _check(db: sqlite3.Connection, report: RegistryReport) -> None:
    tables = {row[0] for row in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    integrity = [str(row[0]) for row in db.execute(f"PRAGMA integrity_check({MAX_LISTED})")]
    if integrity != ["ok"]:
        report.problems += [f"integrity: {line}" for line in integrity]
    if not tables:
        return  # a database with nothing in it yet
    version = _schema_version(db, tables, report)
    if version is not None and version > SCHEMA_VERSION:
        report.newer_schema = True
        report.problems.append(f"schema version {version} is newer than this loraplex understands "
                               f"({SCHEMA_VERSION}): upgrade loraplex (this is no damage; repair leaves it alone)")
        return
    if "adapters" not in tables:
        report.problems.append("the adapters table is missing")
        return
    _check_rows(db, report)


def _schema_version(db: sqlite3.Connection, tables: set[str], report: RegistryReport) -> int | None:
    if "schema_version" not in tables:
        report.problems.append("the schema_version table is missing")
        return None
    versions = [row[0] for row in db.execute("SELECT version FROM schema_version")]
    if len(versions) != 1 or type(versions[0]) is not int or not 1 <= versions[0]:
        report.problems.append(f"schema_version holds {versions[:4]!r}, not one version number")
        return None
    return int(versions[0])


def _check_rows(db: sqlite3.Connection, report: RegistryReport) -> None:
    present = [row[1] for row in db.execute("PRAGMA table_info(adapters)")]
    missing = [c for c in COLUMNS if c not in present and c not in _DEFAULTS]
    if missing:
        report.problems.append(f"the adapters table lacks the columns {', '.join(missing)}")
        report.dropped.append("every entry: the adapters table lacks required columns")
        return
    read = [c for c in COLUMNS if c in present]
    cursor = db.execute(f"SELECT rowid, {', '.join(read)} FROM adapters ORDER BY rowid")
    seen: set[tuple[object, object]] = set()
    last = None
    try:
        for values in cursor:
            last = values[0]
            row = {**_DEFAULTS, **dict(zip(read, values[1:]))}
            label = f"row {values[0]} ({_shown(row.get('model'))}/{_shown(row.get('name'))})"
            why = _invalid(row) or ("a second entry of this model and name" if (row["model"], row["name"]) in seen
                                    else None)
            if why:
                report.problems.append(f"{label}: {why}")
                report.dropped.append(f"{label}: {why}")
                continue
            seen.add((row["model"], row["name"]))
            report.rows.append(row)
    except sqlite3.Error as exc:
        after = "" if last is None else f" after row {last}"
        report.problems.append(f"the entries{after} cannot be read: {exc}")
        report.dropped.append(f"the entries{after}: unreadable ({exc})")


def _invalid(row: dict[str, object]) -> str | None:
    """Why this row would not load (None: valid), checking what the registry's own reads assume."""
    model, path, rank, modules = row["model"], row["path"], row["rank"], row["target_modules"]
    if not isinstance(model, str) or len(model) > MAX_NAME_LEN:
        return f"model scope {_shown(model)} is not a string of at most {MAX_NAME_LEN} chars"
    if not is_valid_name(row["name"]):
        return f"name {_shown(row['name'])} breaks the adapter name rule"
    if not isinstance(path, str) or not 1 <= len(path) <= MAX_PATH_LEN or "\x00" in path or not os.path.isabs(path):
        return f"path {_shown(path)} is not an absolute path"
    if rank is not None and (type(rank) is not int or rank <= 0):
        return f"rank {_shown(rank)} is not a positive integer"
    try:
        decoded = json.loads(modules) if isinstance(modules, str) else None
    except ValueError:
        decoded = None
    if not isinstance(decoded, list) or not all(isinstance(m, str) and m for m in decoded):
        return f"target_modules {_shown(modules)} is not a JSON list of module names"
    if row["pinned"] not in (0, 1) or type(row["pinned"]) is not int:
        return f"pinned {_shown(row['pinned'])} is not 0 or 1"
    added = row["added_at"]
    if type(added) not in (int, float) or not math.isfinite(added):  # type: ignore[arg-type]
        return f"added_at {_shown(added)} is not a time"
    if row["source"] not in SOURCES:
        return f"source {_shown(row['source'])} is not one of {', '.join(SOURCES)}"
    if not isinstance(row["content_hash"], str) or not isinstance(row["fingerprint"], str):
        return "content_hash or fingerprint is not text"
    if type(row["uses"]) is not int or row["uses"] < 0:  # type: ignore[operator]
        return f"uses {_shown(row['uses'])} is not a count"
    return None


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def repair_registry(path: Path, report: RegistryReport | None = None) -> RepairResult:
    """Keep the old file as `<name>.<UTC time>.bak` (its -wal and -shm renamed alike, so the backup
    opens as it was) and put a new file holding `report.rows` in its place. The caller holds the state
    directory's lock (daemon/state_lock.py): no daemon may have the file open meanwhile."""
    report = report if report is not None else check_registry(path)
    if report.newer_schema:
        raise ValueError(f"{path} was written by a newer loraplex; upgrade loraplex instead of repairing it")
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    backup = path.with_name(f"{path.name}.{stamp}.bak")
    n = 1
    while backup.exists():
        backup = path.with_name(f"{path.name}.{stamp}-{n}.bak")
        n += 1
    fresh = path.with_name(f"{path.name}.repair-tmp")
    _write(fresh, report.rows)
    os.replace(path, backup)
    for suffix in _SIDE_FILES:
        side = path.with_name(path.name + suffix)
        if side.exists():
            os.replace(side, backup.with_name(backup.name + suffix))
    os.replace(fresh, path)
    _fsync_dir(path.parent)
    return RepairResult(backup, len(report.rows), list(report.dropped))


def _write(fresh: Path, rows: list[dict[str, object]]) -> None:
    """A complete registry of `rows` at `fresh` (one file, rollback journal, synced), as the daemon's
    migrations would have built it."""
    for stale in [fresh, *(fresh.with_name(fresh.name + s) for s in ("-journal", *_SIDE_FILES))]:
        stale.unlink(missing_ok=True)
    os.close(os.open(fresh, os.O_CREAT | os.O_EXCL | os.O_WRONLY | getattr(os, "O_NOFOLLOW", 0), 0o600))
    db = sqlite3.connect(fresh, isolation_level=None)
    try:
        db.execute("PRAGMA journal_mode = DELETE")
        db.execute("PRAGMA synchronous = FULL")
        db.execute("BEGIN IMMEDIATE")
        db.execute("CREATE TABLE schema_version (version INTEGER NOT NULL)")
        for statements in MIGRATIONS:
            for statement in statements:
                db.execute(statement)
        db.execute("INSERT INTO schema_version (version) VALUES (?)", (SCHEMA_VERSION,))
        db.executemany(f"INSERT INTO adapters ({', '.join(COLUMNS)}) VALUES ({', '.join('?' * len(COLUMNS))})",
                       [tuple(row[c] for c in COLUMNS) for row in rows])
        db.execute("COMMIT")
    finally:
        db.close()
    fd = os.open(fresh, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
