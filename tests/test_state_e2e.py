"""The state directory under a real daemon: a second daemon of the same model on it is refused in one
line naming the first one's pid (as is a registry repair), and with the state disk unwritable for real
(the daemon's file size limit lowered, so its registry write fails in write(2) as on a full disk)
`adapters add` and `rm` are refused and change nothing: the adapter is neither served nor registered,
so a restart agrees with what clients were told."""
from __future__ import annotations

import resource
import sqlite3
import subprocess
import sys
from contextlib import contextmanager

import pytest

from loraplex.ipc.client import AdminClient, LoraplexError
from tests.daemon_process import DaemonProcess


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    proc = DaemonProcess(tmp_path_factory.mktemp("state-e2e")).start()
    yield proc
    assert proc.stop() == 0, proc.log()


def _cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "loraplex.cli", *args], env=env, capture_output=True, text=True,
                          timeout=120)


def test_a_second_daemon_on_the_state_directory_is_refused_naming_the_first(daemon, tmp_path):
    env = {**daemon.env, "LORAPLEX_RUNTIME_DIR": str(tmp_path / "rt")}  # its own sockets, the same state
    proc = _cli("serve", env=env)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.splitlines() == [
        f"loraplex serve: error: state directory {daemon.state_dir} is in use by another loraplex daemon serving "
        f"this base model (pid {daemon.proc.pid}); stop it first, or give this one another --state-dir"]
    repair = _cli("registry", "repair", env=env)
    assert repair.returncode == 0 and "nothing to repair" in repair.stdout, repair.stderr  # sound: nothing to do
    with sqlite3.connect(daemon.state_dir / "registry.sqlite3") as db:
        db.execute("INSERT INTO adapters (model, name, path, added_at, source) VALUES ('x', 'bad', 'rel', 0, 'cli')")
    try:
        repair = _cli("registry", "repair", env=env)
        assert repair.returncode == 1 and repair.stderr == (
            f"loraplex registry: error: state directory {daemon.state_dir} is in use by a loraplex daemon "
            f"(pid {daemon.proc.pid}); stop it first\n"), repair.stderr
    finally:
        with sqlite3.connect(daemon.state_dir / "registry.sqlite3") as db:
            db.execute("DELETE FROM adapters WHERE model = 'x'")
    with daemon.client() as client:
        assert client.ping(timeout=5.0) >= 0  # the first daemon is untouched


@contextmanager
def no_room_to_write(pid: int):
    """The daemon may write no byte past offset 4096 of any file: its registry's next WAL frame fails
    with EFBIG (its log lines are lost meanwhile; Python ignores SIGXFSZ)."""
    soft, hard = resource.prlimit(pid, resource.RLIMIT_FSIZE)
    resource.prlimit(pid, resource.RLIMIT_FSIZE, (4096, hard))
    try:
        yield
    finally:
        resource.prlimit(pid, resource.RLIMIT_FSIZE, (soft, hard))


def _registered(daemon, name: str) -> bool:
    with sqlite3.connect(f"file:{daemon.state_dir / 'registry.sqlite3'}?mode=ro", uri=True) as db:
        return db.execute("SELECT COUNT(*) FROM adapters WHERE name = ?", (name,)).fetchone()[0] > 0


def test_with_the_state_disk_unwritable_add_and_rm_change_nothing(daemon, demo):
    path = str(demo.adapters["qv-r8"])
    with AdminClient(runtime_dir=daemon.runtime_dir) as admin:
        admin.add_adapter("kept", path)
        with no_room_to_write(daemon.proc.pid):
            with pytest.raises(LoraplexError) as added:
                admin.add_adapter("lost", path)
            with pytest.raises(LoraplexError) as removed:
                admin.remove_adapter("kept")
            listed = {a.name for a in admin.adapters()}
        assert "lost" not in listed and "kept" in listed, "the daemon serves what the registry does not hold"
        assert added.value.code.value == "internal" and "was not registered" in str(added.value), added.value
        assert "was not removed" in str(removed.value), removed.value
        assert not _registered(daemon, "lost") and _registered(daemon, "kept")
        with daemon.client() as client:
            with pytest.raises(LoraplexError) as err:
                client.generate([5, 6, 7], adapter="lost", max_tokens=2, timeout=60)
            assert err.value.code.value == "unknown_adapter"
            assert len(client.generate([5, 6, 7], adapter="kept", max_tokens=2, timeout=60).token_ids) == 2
        admin.add_adapter("lost", path)  # room again: the same order goes through
        admin.remove_adapter("kept")
    assert _registered(daemon, "lost") and not _registered(daemon, "kept")
