"""One daemon per base model per state directory, and no registry repair under a daemon
(daemon/state_lock.py): a second daemon of the same model is refused naming the first one's pid,
daemons of other models share the directory, a repair excludes every daemon and the other way
round; the locks go when released and when the holder dies however it dies (SIGKILL included),
and a child process never inherits them."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from loraplex.daemon.state_lock import StateDirLocked, StateLock, scope_lock_name

HOLD = """
import sys, time
from pathlib import Path
from loraplex.daemon.state_lock import StateLock
lock = StateLock.for_daemon(Path(sys.argv[1]), sys.argv[2])
print("held", flush=True)
time.sleep(600)
"""


def test_one_daemon_per_model_and_repair_excludes_them_all(tmp_path):
    me = os.getpid()
    with StateLock.for_daemon(tmp_path, "llama-0123456789abcdef") as lock:
        assert lock.held and (tmp_path / "daemon-llama-0123456789abcdef.lock").read_text() == f"{me}\n"
        with pytest.raises(StateDirLocked) as err:
            StateLock.for_daemon(tmp_path, "llama-0123456789abcdef")
        assert err.value.pid == me and str(err.value) == (
            f"state directory {tmp_path} is in use by another loraplex daemon serving this base model (pid {me}); "
            "stop it first, or give this one another --state-dir")
        StateLock.for_daemon(tmp_path, "demo-trained").release()  # another model shares the directory
        with pytest.raises(StateDirLocked) as err:
            StateLock.exclusive(tmp_path)
        assert str(err.value) == f"state directory {tmp_path} is in use by a loraplex daemon (pid {me}); stop it first"
    assert not lock.held
    with StateLock.exclusive(tmp_path):  # a repair: no daemon may start meanwhile
        with pytest.raises(StateDirLocked, match=rf"is being repaired \(pid {me}\)"):
            StateLock.for_daemon(tmp_path, "demo-trained")
    StateLock.for_daemon(tmp_path, "demo-trained").release()


def test_a_scope_unfit_for_a_file_name_is_hashed():
    assert scope_lock_name("demo-trained") == "daemon-demo-trained.lock"
    for odd in ("demo-../../x", "demo-a b", "..", "x" * 200):
        name = scope_lock_name(odd)
        assert name.startswith("daemon-") and "/" not in name and len(name) == len("daemon-") + 16 + len(".lock")


def test_a_killed_holder_lets_go_and_a_child_never_holds_it(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path), "demo-trained"], stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        with pytest.raises(StateDirLocked) as err:
            StateLock.for_daemon(tmp_path, "demo-trained")
        assert err.value.pid == holder.pid
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
        holder.stdout.close()
    lock = StateLock.for_daemon(tmp_path, "demo-trained")  # the kernel let go with the process
    child = subprocess.Popen([sys.executable, "-c", "import time; print('up', flush=True); time.sleep(600)"],
                             close_fds=False, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline() == "up\n"  # past its exec (which drops close-on-exec files lazily)
        lock.release()
        StateLock.exclusive(tmp_path).release()  # the child (alive) holds neither of the daemon's locks
    finally:
        child.kill()
        child.wait()
        child.stdout.close()
