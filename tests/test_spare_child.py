"""Warm spare children (server.spare_children) against a real daemon on CPU: each link
keeps one pre-imported spare named for its role; a SIGKILLed engine is replaced by that very
process and its requests finish exactly; a dead spare means a cold start that still works; and
stopping the daemon leaves no spare behind."""
from __future__ import annotations

import asyncio
import os
import signal
import socket
import tempfile
from pathlib import Path

import pytest

from tests.daemon_process import SPARES, DaemonProcess
from tests.test_faults import DECODE_PROMPT, Streamer, _alive, _model_args, _segments, _stats, _wait, offline

__all__ = ["offline"]  # the offline-reference fixture, shared with test_faults


def test_a_spare_pipe_is_polled_until_watched_and_its_old_byte_never_counts_as_silence():
    from loraplex.ipc.heartbeat import HeartbeatWatch

    beat = HeartbeatWatch(0.6)
    assert not beat.poll()
    os.write(beat.child_fd, b"+")  # the spare's "imports done"
    assert beat.poll() and not beat.closed

    async def watched() -> list[str]:
        seen: list[str] = []
        beat.last_beat -= 60  # the spare waited a minute before it was needed
        beat.watch(lambda s: seen.append(f"silent {s:.1f}"), lambda: seen.append("closed"))
        await asyncio.sleep(0.3)  # checked at least once before the first new beat
        for _ in range(4):
            os.write(beat.child_fd, b".")
            await asyncio.sleep(0.2)
        assert seen == [], seen  # an old byte is no silence: it counts from watch()
        await asyncio.sleep(1.2)
        return seen

    seen = asyncio.run(watched())
    assert len(seen) == 1 and seen[0].startswith("silent"), seen
    assert beat.closed
    other = HeartbeatWatch(1.0)
    other.spawned()  # no writer left: EOF, as when a spare died before it was needed
    assert not other.poll() and other.closed


def _children(pid: int) -> list[int]:
    kids = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        kids += [int(k) for k in (task / "children").read_text().split()]
    return kids


def _cmdline(pid: int) -> list[bytes]:
    return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")


def _spares(daemon) -> list[int]:
    """The daemon's children still waiting as spares (engine's and cache manager's)."""
    return [k for k in _children(daemon.proc.pid) if _alive(k) and b"--standby" in _cmdline(k)
            and Path(f"/proc/{k}/comm").read_text().strip() == "loraplex-spare"]


def _spare_pid(daemon) -> int:
    """The engine's spare, once its imports are done."""
    engine = _wait(lambda: (e := _stats(daemon)["engine"])["spare_ready"] and e, 60, "the engine's warm spare")
    return engine["spare_pid"]


@pytest.fixture(scope="module")
def daemon(demo):
    short = Path(tempfile.mkdtemp(prefix="lpx-spare-"))  # a short path: AF_UNIX names are bounded
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    listener.bind(str(short / "notify.sock"))
    proc = DaemonProcess(short, *_model_args(demo), "--host-store-bytes", "3500000",
                         env={"NOTIFY_SOCKET": str(short / "notify.sock"), **SPARES}).start()
    yield proc
    proc.stop()
    listener.close()


def test_each_link_keeps_a_spare_named_for_its_role(daemon):
    pid = _spare_pid(daemon)
    cmdline = _cmdline(pid)
    assert b"loraplex.standby" in cmdline and b"--standby" in cmdline, cmdline
    assert b"loraplex.gpu_engine.engine_process" in cmdline and b"--spec" not in cmdline, cmdline
    assert Path(f"/proc/{pid}/comm").read_text().strip() == "loraplex-spare"
    assert int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1]) == daemon.proc.pid
    assert b"NOTIFY_SOCKET" not in Path(f"/proc/{pid}/environ").read_bytes()
    # Only the import thread was niced: the main thread, which will serve, keeps the daemon's priority.
    assert int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[16]) == os.getpriority(
        os.PRIO_PROCESS, daemon.proc.pid)
    spares = _wait(lambda: len(s := _spares(daemon)) == 2 and s, 60, "the cache manager's spare too")
    roles = {next(a for a in _cmdline(k) if a.startswith(b"loraplex.gpu_engine.")) for k in spares}
    assert roles == {b"loraplex.gpu_engine.engine_process", b"loraplex.gpu_engine.cache_manager_process"}


def test_a_killed_engine_is_replaced_by_its_spare_and_requests_finish_exactly(daemon, offline):
    spare = _spare_pid(daemon)
    before = _stats(daemon)["engine"]
    expected = offline(DECODE_PROMPT, "qv-r8", 16)
    req = Streamer(daemon, DECODE_PROMPT, adapter="qv-r8", max_tokens=16)
    _wait(lambda: len(req.chunks) >= 3, 30, "three tokens", interval_s=0.01)
    os.kill(before["pid"], signal.SIGKILL)
    req.finish().check_exact(expected)
    now = _wait(lambda: (e := _stats(daemon)["engine"])["pid"] != before["pid"] and e["ready"] and e, 30,
                "the engine to be replaced")
    assert now["pid"] == spare and now["spare_handoffs"] == before["spare_handoffs"] + 1, now
    assert Path(f"/proc/{spare}/comm").read_text().strip() == "loraplex-engine"
    # The next spare comes after the replacement's hello.
    assert _spare_pid(daemon) not in (spare, before["pid"])


def test_with_the_spare_dead_the_engine_restarts_cold(daemon, offline):
    spare = _spare_pid(daemon)
    os.kill(spare, signal.SIGKILL)
    _wait(lambda: _stats(daemon)["engine"]["spare_pid"] is None, 10, "the dead spare to be reaped")
    before = _stats(daemon)["engine"]
    expected = offline(DECODE_PROMPT, None, 12)
    req = Streamer(daemon, DECODE_PROMPT, max_tokens=12)
    _wait(lambda: len(req.chunks) >= 3, 30, "three tokens", interval_s=0.01)
    os.kill(before["pid"], signal.SIGKILL)
    req.finish().check_exact(expected)
    now = _wait(lambda: (e := _stats(daemon)["engine"])["pid"] != before["pid"] and e["ready"] and e, 30,
                "the engine to be replaced")
    assert now["pid"] != spare and now["spare_handoffs"] == before["spare_handoffs"], now
    assert b"--standby" not in _cmdline(now["pid"])
    assert f"spare pid {spare} unusable" in daemon.log()


def test_stopping_the_daemon_leaves_no_spare_behind(daemon):
    _spare_pid(daemon)
    spares = _wait(lambda: len(s := _spares(daemon)) == 2 and s, 60, "both spares")
    instance = daemon.instance
    assert daemon.stop() == 0, daemon.log()
    assert not [p for p in spares if _alive(p)], "a spare outlived the daemon"
    assert not _segments(instance), "shared-memory segments left behind"
