"""One replica's loraplex daemon: a `loraplex serve` child process with its own runtime and
state directories (short paths under the temp dir, for the Unix socket length limit), started
and awaited until it answers a ping, stopped with SIGTERM (it drains) and reaped.

The child gets SIGTERM when the replica's process dies (PR_SET_PDEATHSIG on Linux), so a
replica that Ray kills leaves no daemon behind; the directories such a replica leaves are
removed by the next replica started on the host (each names its owner's pid).
"""
from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from loraplex.ipc.client import AsyncClient, LoraplexError

log = logging.getLogger("loraplex.cluster")
PREFIX = "lpx-cl-"
OWNER_FILE = "owner.pid"
START_TIMEOUT_S = 300.0
STOP_TIMEOUT_S = 30.0
_PR_SET_PDEATHSIG = 1


try:  # resolved here, not in the child: between fork and exec only the call itself runs
    _prctl = ctypes.CDLL(None, use_errno=True).prctl
except (OSError, AttributeError):  # not Linux: the replica's __del__ still stops the daemon
    _prctl = None


def _die_with_parent() -> None:  # runs in the child between fork and exec
    if _prctl is not None:
        _prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def sweep_orphans(tmp: Path) -> list[Path]:
    """Remove the directories of replicas whose process is gone (killed before it could clean up)."""
    removed = []
    for root in tmp.glob(f"{PREFIX}*"):
        try:
            owner = int((root / OWNER_FILE).read_text())
        except (OSError, ValueError):
            continue  # not ours, or still being created
        if owner != os.getpid() and not Path(f"/proc/{owner}").exists():
            shutil.rmtree(root, ignore_errors=True)
            removed.append(root)
    return removed


class DaemonChild:
    def __init__(self, *, config: Path | None, args: Sequence[str] = (), env: Mapping[str, str] | None = None) -> None:
        if Path("/proc/self").exists():
            sweep_orphans(Path(tempfile.gettempdir()))
        self.root = Path(tempfile.mkdtemp(prefix=PREFIX))
        (self.root / OWNER_FILE).write_text(str(os.getpid()))
        self.runtime_dir = self.root / "rt"
        self.log_path = self.root / "daemon.log"
        self._argv = [sys.executable, "-m", "loraplex.cli", "serve", *(["--config", str(config)] if config else []),
                      *args]
        self._env = {**os.environ, "LORAPLEX_RUNTIME_DIR": str(self.runtime_dir),
                     "LORAPLEX_STATE_DIR": str(self.root / "state"), **(env or {})}
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    async def start(self, timeout_s: float = START_TIMEOUT_S) -> None:
        """Start the daemon and wait until it answers; RuntimeError with its log if it exits or
        does not come up in time (it is then killed)."""
        with self.log_path.open("ab") as out:
            self.proc = subprocess.Popen(self._argv, env=self._env, stdout=out, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent)
        deadline = time.monotonic() + timeout_s
        async with AsyncClient(runtime_dir=self.runtime_dir) as probe:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"the replica's daemon exited with {self.proc.returncode}:\n{self.log()}")
                if (self.runtime_dir / "client.sock").exists():
                    try:
                        await probe.ping(timeout=2.0)
                        return
                    except LoraplexError:
                        pass
                await asyncio.sleep(0.2)  # the daemon offers no readiness event to a foreign parent
        await self.stop(sig=signal.SIGKILL)
        raise RuntimeError(f"the replica's daemon did not come up in {timeout_s:g} s:\n{self.log()}")

    def log(self, tail: int = 4000) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return text[-tail:]

    async def stop(self, sig: int = signal.SIGTERM, timeout_s: float = STOP_TIMEOUT_S) -> int | None:
        """Signal the daemon (SIGTERM drains), wait for it (SIGKILL after timeout_s), remove its
        directories; its exit status (None if it never started)."""
        proc = self.proc
        if proc is None:
            return None
        if proc.poll() is None:
            proc.send_signal(sig)
            try:
                await asyncio.to_thread(proc.wait, timeout_s)
            except subprocess.TimeoutExpired:
                log.warning("the replica's daemon did not stop in %g s; killing it", timeout_s)
                proc.kill()
                await asyncio.to_thread(proc.wait)
        shutil.rmtree(self.root, ignore_errors=True)
        return proc.returncode
