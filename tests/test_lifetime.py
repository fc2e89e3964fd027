"""Children that own shared memory unlink it when their parent is SIGKILLed, then
die (loraplex.lifetime's pidfd watcher), instead of leaving it in /dev/shm
until the next daemon starts; children without a cleanup still die at once."""
from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from loraplex.ipc.shm import SHM_DIR

CHILD = textwrap.dedent("""
    import sys, time
    from loraplex.ipc.shm import SharedSegment, unlink_owned
    from loraplex.lifetime import die_with_parent
    die_with_parent("lpx-test-child", on_parent_death=unlink_owned if sys.argv[2] == "clean" else None)
    segment = SharedSegment.create(sys.argv[1], 1 << 16)
    print("ready", flush=True)
    time.sleep(120)
""")
PARENT = textwrap.dedent("""
    import subprocess, sys
    child = subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2], sys.argv[3]])
    print(child.pid, flush=True)
    child.wait()
""")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def _wait(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


@pytest.mark.parametrize("mode", ["clean", "plain"])
def test_a_child_unlinks_its_segments_when_the_parent_is_sigkilled(mode):
    name = f"/lpx-lifetime{secrets.token_hex(4)}-{mode}"
    path = Path(SHM_DIR) / name[1:]
    parent = subprocess.Popen([sys.executable, "-c", PARENT, CHILD, name, mode], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    try:
        child = int(parent.stdout.readline())
        assert parent.stdout.readline().strip() == "ready"
        assert path.exists()
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
        _wait(lambda: not _alive(child), 10, "the child to die with its parent")
        if mode == "clean":
            assert not path.exists(), "the child left its segment behind"
        else:  # no cleanup given: the kernel's PDEATHSIG SIGKILL, the segment stays for the next sweep
            assert path.exists()
    finally:
        parent.kill()
        path.unlink(missing_ok=True)
