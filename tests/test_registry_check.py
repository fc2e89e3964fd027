"""A damaged adapter registry (daemon/registry_check.py, `loraplex registry check | repair`): every kind
of bad entry and a file that is not a database at all are found without changing the file; the daemon
refuses to start on one with a single line naming the way out (no traceback); repair keeps the old
file as a timestamped backup, keeps every valid entry exactly and lists what it dropped, and is
refused while a daemon holds the state directory."""
from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
from contextlib import closing
from pathlib import Path

import pytest

from loraplex.cli import main as cli_main
from loraplex.daemon.registry import SCHEMA_VERSION, AdapterRegistry
from loraplex.daemon.registry_check import check_registry, repair_registry
from loraplex.daemon.state_lock import StateLock


@pytest.fixture
def state(tmp_path: Path) -> Path:
    """A state directory whose registry holds two valid adapters (one pinned and used) under two models."""
    state = tmp_path / "state"
    with AdapterRegistry(state / "registry.sqlite3", model="m") as reg:
        reg.add("a", "/srv/a", rank=8, target_modules=["q_proj"], content_hash="h" * 64, fingerprint="f")
        reg.set_pinned("a", True)
        reg.add_uses({"a": 7})
    with AdapterRegistry(state / "registry.sqlite3", model="other") as reg:
        reg.add("b", "/srv/b")
    return state


def _rows(state: Path) -> list[tuple]:
    # Closed here, not whenever it is collected: closing the last connection checkpoints the WAL
    # into the main file, which would change the file under a test that compares its bytes.
    with closing(sqlite3.connect(state / "registry.sqlite3")) as db:
        return db.execute("SELECT * FROM adapters ORDER BY model, name").fetchall()


def _corrupt(state: Path, sql: str, *args: object) -> None:
    db = sqlite3.connect(state / "registry.sqlite3", isolation_level=None)
    db.execute(sql, args)
    db.close()


def test_a_sound_registry_passes_and_a_missing_or_empty_one_is_new(state, tmp_path):
    report = check_registry(state / "registry.sqlite3")
    assert report.ok and len(report.rows) == 2
    assert check_registry(tmp_path / "nowhere" / "registry.sqlite3").ok
    (tmp_path / "empty.sqlite3").write_bytes(b"")
    assert check_registry(tmp_path / "empty.sqlite3").ok


@pytest.mark.parametrize("column, value, fragment", [
    ("name", "../etc", "breaks the adapter name rule"),
    ("path", "relative/dir", "is not an absolute path"),
    ("path", 42, "is not an absolute path"),
    ("rank", -3, "is not a positive integer"),
    ("rank", "eight", "is not a positive integer"),
    ("target_modules", "{not json", "is not a JSON list of module names"),
    ("target_modules", "[1, 2]", "is not a JSON list of module names"),
    ("pinned", 2, "is not 0 or 1"),
    ("added_at", "yesterday", "is not a time"),
    ("source", "evil", "is not one of cli, admin, flag, config"),
    ("uses", -1, "is not a count"),
    ("model", "x" * 129, "is not a string of at most 128 chars"),
])
def test_every_kind_of_bad_entry_is_found_and_repair_keeps_the_rest(state, column, value, fragment):
    good = [row for row in _rows(state) if row[1] == "b"]
    _corrupt(state, f"UPDATE adapters SET {column} = ? WHERE name = 'a'", value)
    path = state / "registry.sqlite3"
    damaged = path.read_bytes()
    report = check_registry(path)
    assert len(report.problems) == 1 and fragment in report.problems[0], report.problems
    assert path.read_bytes() == damaged, "check changed the file"
    result = repair_registry(path, report)
    assert result.kept == 1 and len(result.dropped) == 1 and fragment in result.dropped[0]
    assert result.backup.read_bytes() == damaged and result.backup.name.startswith("registry.sqlite3.")
    assert _rows(state) == good and check_registry(path).ok


def test_a_file_that_is_no_database_is_found_and_repaired_to_an_empty_registry(state):
    path = state / "registry.sqlite3"
    garbage = os.urandom(8192)
    path.write_bytes(garbage)
    report = check_registry(path)
    assert report.problems == ["unreadable: file is not a database"], report.problems
    result = repair_registry(path, report)
    assert result.kept == 0 and result.dropped == ["every entry: the file is unreadable (file is not a database)"]
    assert result.backup.read_bytes() == garbage
    with AdapterRegistry(path, model="m") as reg:
        assert reg.list() == [] and reg.schema_version == SCHEMA_VERSION


def test_a_truncated_file_keeps_what_can_be_read(state):
    path = state / "registry.sqlite3"
    with AdapterRegistry(path, model="m") as reg:  # enough rows for several pages
        for i in range(400):
            reg.add(f"n{i:03d}", f"/srv/{'p' * 200}/{i}")
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.truncate(size // 2)
    report = check_registry(path)
    assert not report.ok, "half a file passed the check"
    result = repair_registry(path, report)
    assert check_registry(path).ok and result.kept == len(_rows(state)) < 402


def test_structure_problems_and_a_newer_schema(state):
    path = state / "registry.sqlite3"
    _corrupt(state, "UPDATE schema_version SET version = ?", SCHEMA_VERSION + 1)
    report = check_registry(path)
    assert report.newer_schema and "newer than this loraplex understands" in report.problems[0]
    with pytest.raises(ValueError, match="upgrade loraplex"):
        repair_registry(path, report)
    _corrupt(state, "UPDATE schema_version SET version = ?", SCHEMA_VERSION)
    _corrupt(state, "DROP TABLE adapters")
    assert check_registry(path).problems == ["the adapters table is missing"]


def test_the_commands_check_and_repair_and_repair_waits_for_no_daemon(state, capsys):
    path = state / "registry.sqlite3"
    assert cli_main(["registry", "check", "--state-dir", str(state)]) == 0
    assert capsys.readouterr().out == f"{path}: ok (2 adapters)\n"
    _corrupt(state, "UPDATE adapters SET source = 'evil' WHERE name = 'b'")
    assert cli_main(["registry", "--state-dir", str(state), "check"]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"{path}: 1 problem" and "source 'evil'" in out[1] and "the 1 valid entries" in out[2]
    with StateLock.for_daemon(state, "m"):  # a daemon runs on it
        assert cli_main(["registry", "repair", "--state-dir", str(state)]) == 1
        err = capsys.readouterr().err
        assert err == (f"loraplex registry: error: state directory {state} is in use by a loraplex daemon "
                       f"(pid {os.getpid()}); stop it first\n")
    assert not check_registry(path).ok, "repair changed the file under a daemon"
    assert cli_main(["registry", "repair", "--state-dir", str(state)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(f"{path}: repaired; the old file is kept as {path}.") and out[0].endswith(".bak")
    assert out[1] == "kept 1 adapters, dropped 1:" and "source 'evil'" in out[2]
    assert cli_main(["registry", "repair", "--state-dir", str(state)]) == 0
    assert capsys.readouterr().out == f"{path}: ok (1 adapters), nothing to repair\n"


@pytest.mark.parametrize("damage", ["garbage", "bad entry"])
def test_the_daemon_refuses_a_damaged_registry_in_one_line(state, tmp_path, damage):
    path = state / "registry.sqlite3"
    if damage == "garbage":
        path.write_bytes(os.urandom(4096))
        problem = "unreadable: file is not a database"
    else:
        _corrupt(state, "UPDATE adapters SET target_modules = '{' WHERE name = 'a'")
        problem = "row 1 ('m'/'a'): target_modules '{' is not a JSON list of module names"
    env = {**os.environ, "LORAPLEX_RUNTIME_DIR": str(tmp_path / "rt"), "LORAPLEX_STATE_DIR": str(state)}
    proc = subprocess.run([sys.executable, "-m", "loraplex.cli", "serve"], env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.splitlines() == [
        f"loraplexd ERROR adapter registry {path} cannot be used: {problem}; `loraplex registry check` lists the "
        "problems, `loraplex registry repair` keeps a backup of the file and rewrites the entries that are still "
        "valid"], proc.stderr
