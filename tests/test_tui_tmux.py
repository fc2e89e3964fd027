"""`loraplex top` in a real terminal: a detached 80x24 tmux session against a
live daemon on the demo model. The panels show, a live value moves when a
request completes, a daemon restart shows DISCONNECTED and then LIVE again,
and `q` quits. Slow (starts the daemon twice); skipped without tmux."""
from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.daemon_process import DaemonProcess

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed (apt-get install tmux)"),
]
TITLES = ("Daemon health", "Requests", "Queues", "Cache", "PCIe", "Workers", "Engines")


class Tmux:
    """A private tmux server (own socket name) holding one detached 80x24 session."""

    def __init__(self, name: str) -> None:
        self.server = f"lpx-test-{os.getpid()}-{name}"
        self.session = name

    def _tmux(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        return subprocess.run(["tmux", "-L", self.server, *args], capture_output=True, text=True, check=check)

    def start(self, command: str) -> None:
        self._tmux("-f", "/dev/null", "new-session", "-d", "-s", self.session, "-x", "80", "-y", "24", command)

    def capture(self) -> str:
        result = self._tmux("capture-pane", "-p", "-t", self.session, check=False)
        return result.stdout

    def keys(self, *keys: str) -> None:
        self._tmux("send-keys", "-t", self.session, *keys)

    def alive(self) -> bool:
        return self._tmux("has-session", "-t", self.session, check=False).returncode == 0

    def kill(self) -> None:
        self._tmux("kill-server", check=False)

    def wait_for(self, predicate, what: str, timeout_s: float = 30.0) -> str:
        deadline = time.monotonic() + timeout_s
        screen = ""
        while time.monotonic() < deadline:
            screen = self.capture()
            if predicate(screen):
                return screen
            time.sleep(0.25)
        raise AssertionError(f"{what} not shown within {timeout_s:g} s; the screen:\n{screen}")


def test_top_in_tmux_against_a_live_daemon(demo, tmp_path: Path):
    daemon = DaemonProcess(tmp_path).start()
    tmux = Tmux("top")
    try:
        env = {"LORAPLEX_RUNTIME_DIR": str(daemon.runtime_dir), "TERM": "xterm-256color", "COLUMNS": "80",
               "LINES": "24"}
        command = " ".join([*(f"{k}={shlex.quote(v)}" for k, v in env.items()),
                            shlex.quote(sys.executable), "-m", "loraplex.cli", "top",
                            "--runtime-dir", shlex.quote(str(daemon.runtime_dir))])
        tmux.start(f"env {command}")
        screen = tmux.wait_for(lambda s: "LIVE" in s, "the LIVE state")
        for title in TITLES:
            assert title in screen, f"{title!r} missing:\n{screen}"
        assert "pages 600" in screen  # the daemon's real pool size (DaemonProcess passes --num-pages 600)
        assert max(len(line) for line in screen.splitlines()) <= 80

        with daemon.client() as client:
            client.generate("Once upon a time", adapter="qv-r8", max_tokens=8, temperature=0.0)
        tmux.wait_for(lambda s: "done 1" in s, "the completed request")

        assert daemon.stop() == 0
        tmux.wait_for(lambda s: "DISCONNECTED" in s, "the DISCONNECTED state")
        daemon.start()
        screen = tmux.wait_for(lambda s: "LIVE" in s and "done 0" in s, "LIVE again after the restart", 60.0)

        tmux.keys("q")
        deadline = time.monotonic() + 10
        while tmux.alive() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not tmux.alive(), f"`q` did not quit; the screen:\n{tmux.capture()}"
    finally:
        tmux.kill()
        daemon.stop()
