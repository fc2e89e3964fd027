"""Heartbeats from a child process to the daemon over an inherited pipe.

The child writes one byte every BEAT_INTERVAL_S from a daemon thread (a busy
main loop keeps beating; a stopped process, or one stuck holding the GIL,
falls silent); the daemon watches the read end on its event loop and is told
when the child went silent or the pipe closed (the child exited).
Stdlib only: never imports zmq or torch, never blocks the event loop.
"""
from __future__ import annotations

import asyncio
import os
import threading
import time
from typing import Callable

BEAT_INTERVAL_S = 0.5
HEARTBEAT_FD_FLAG = "--heartbeat-fd"  # the children's command-line option naming the write end


def start_beating(fd: int, interval_s: float = BEAT_INTERVAL_S) -> threading.Thread:
    """Child side: write a byte to `fd` every `interval_s` until the daemon closes its end."""
    os.set_blocking(fd, False)

    def beat() -> None:
        while True:
            try:
                os.write(fd, b".")
            except BlockingIOError:
                pass  # the daemon is behind on reading: the bytes already queued say we live
            except OSError:
                return  # the daemon is gone (EPIPE); PDEATHSIG ends us
            time.sleep(interval_s)

    thread = threading.Thread(target=beat, name="heartbeat", daemon=True)
    thread.start()
    return thread


class HeartbeatWatch:
    """Daemon side of one child's heartbeat pipe.

    Create it before spawning, pass `child_fd` to the child (pass_fds) and call
    `spawned()` right after, then `watch()`. `on_silent(seconds)` runs once when
    no byte came for `timeout_s` after the first one (before the first beat the
    caller's start timeout rules); `on_closed()` runs once when the pipe reaches
    EOF, i.e. the child exited. Set `timeout_s` at any time (a longer bound while
    the child loads, say). A warm spare's pipe is made at its spawn but watched
    only once it becomes the running child; until then `poll()` reads it (the
    spare writes one byte when its imports are done).
    """

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._read_fd, self.child_fd = os.pipe()
        os.set_blocking(self._read_fd, False)
        self.last_beat: float | None = None  # monotonic time of the last byte; None before the first
        self._loop: asyncio.AbstractEventLoop | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._on_silent: Callable[[float], None] | None = None
        self._on_closed: Callable[[], None] | None = None
        self._done = False

    def spawned(self) -> None:
        """The child holds the write end now: drop ours, so its exit closes the pipe."""
        if self.child_fd >= 0:
            os.close(self.child_fd)
            self.child_fd = -1

    def watch(self, on_silent: Callable[[float], None], on_closed: Callable[[], None] | None = None) -> None:
        self.last_beat = None  # silence counts from the first beat after this (a spare may have waited long)
        self._loop = asyncio.get_running_loop()
        self._on_silent, self._on_closed = on_silent, on_closed
        self._loop.add_reader(self._read_fd, self._drain)
        self._arm()

    def poll(self) -> bool:
        """Before watch(): read what arrived without the event loop; True once any byte came."""
        if self._loop is None:
            self._drain()
        return self.last_beat is not None

    @property
    def closed(self) -> bool:
        """Closed, or the pipe reached EOF (the child exited): it can no longer be watched."""
        return self._done

    @property
    def silence_s(self) -> float:
        return 0.0 if self.last_beat is None else time.monotonic() - self.last_beat

    def _drain(self) -> bool:
        """Read what the child wrote; False once the pipe closed (then it is no longer watched)."""
        if self._done:
            return False
        try:
            data = os.read(self._read_fd, 4096)
        except BlockingIOError:
            return True
        except OSError:
            data = b""
        if data:
            self.last_beat = time.monotonic()
            return True
        on_closed = self._on_closed
        self.close()
        if on_closed is not None:
            on_closed()
        return False

    def _arm(self) -> None:
        if not self._done and self._loop is not None:
            self._timer = self._loop.call_later(min(BEAT_INTERVAL_S, self.timeout_s / 4), self._check)

    def _check(self) -> None:
        # Read first: after a long stall of our own loop the child's bytes are waiting in the pipe.
        if not self._drain():
            return
        if self.last_beat is not None and self.silence_s > self.timeout_s:
            on_silent, silence = self._on_silent, self.silence_s
            self.close()
            if on_silent is not None:
                on_silent(silence)
            return
        self._arm()

    def close(self) -> None:
        """Stop watching and close both ends (idempotent)."""
        if self._done:
            return
        self._done = True
        if self._timer is not None:
            self._timer.cancel()
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self._read_fd)
        os.close(self._read_fd)
        self.spawned()
