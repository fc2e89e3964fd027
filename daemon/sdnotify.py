"""systemd notification protocol (sd_notify) without extra dependencies.

Sends READY/STATUS/STOPPING/EXTEND_TIMEOUT_USEC/WATCHDOG datagrams to
$NOTIFY_SOCKET (path or abstract '@' socket). A no-op when the daemon is not
started by systemd. The watchdog is pinged from an asyncio task, so a blocked
event loop stops the pings by construction; it also stops while the engine is
down, so systemd restarts a daemon that cannot recover its children.
"""
from __future__ import annotations

import asyncio
import logging
import os
import socket
from typing import Callable

log = logging.getLogger("loraplex.daemon.sdnotify")


class Notifier:
    def __init__(self, env: dict[str, str] | None = None) -> None:
        env = dict(os.environ if env is None else env)
        address = env.get("NOTIFY_SOCKET", "")
        self.address = "\0" + address[1:] if address.startswith("@") else address
        usec = env.get("WATCHDOG_USEC", "")
        pid = env.get("WATCHDOG_PID", "")
        watchdog_for_us = not pid or pid == str(os.getpid())
        self.watchdog_s = int(usec) / 1e6 if usec.isdigit() and int(usec) > 0 and watchdog_for_us else None
        self._sock: socket.socket | None = None
        if self.address:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            self._sock.setblocking(False)

    @property
    def enabled(self) -> bool:
        return self._sock is not None

    def notify(self, *fields: str) -> bool:
        if self._sock is None:
            return False
        try:
            self._sock.sendto("\n".join(fields).encode(), self.address)
            return True
        except OSError as exc:  # systemd gone or the socket full: never fatal to serving
            log.debug("sd_notify failed: %s", exc)
            return False

    def ready(self, status: str) -> None:
        self.notify("READY=1", f"STATUS={status}", f"MAINPID={os.getpid()}")

    def status(self, status: str) -> None:
        self.notify(f"STATUS={status}")

    def extend_timeout(self, seconds: float) -> None:
        self.notify(f"EXTEND_TIMEOUT_USEC={int(seconds * 1e6)}")

    def stopping(self, status: str = "draining") -> None:
        self.notify("STOPPING=1", f"STATUS={status}")

    async def watchdog(self, healthy: Callable[[], bool]) -> None:
        """Ping WATCHDOG=1 at half the interval while `healthy()` holds. A health
        check that raises counts as unhealthy (systemd then restarts us) and is logged."""
        if self.watchdog_s is None:
            return
        while True:
            try:
                ok = healthy()
            except Exception:
                log.exception("watchdog health check failed; withholding WATCHDOG=1")
                ok = False
            if ok:
                self.notify("WATCHDOG=1")
            await asyncio.sleep(self.watchdog_s / 2)

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
