"""The daemon's side of one engine process: start it, exchange orders and
replies over a private ROUTER socket, notice when it dies or hangs.

One order is outstanding at a time (the engine is a synchronous executor),
so replies pair with orders by order. Every wait also watches the process:
a dead or silent engine raises EngineDied instead of hanging the daemon.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
from dataclasses import asdict
from pathlib import Path

import zmq.asyncio

from loraplex.ipc.errors import ErrorCode
from loraplex.ipc.protocol import EngineFailure, EngineHello, EngineShutdown, Message
from loraplex.ipc.runtime_dir import ipc_endpoint
from loraplex.ipc.shm import sweep_stale
from loraplex.ipc.sockets import AsyncTypedSocket, make_router

log = logging.getLogger("loraplex.daemon.engine")


class EngineDied(RuntimeError):
    """The engine process exited or stopped answering."""


class EngineRefused(RuntimeError):
    """The engine answered an order with a failure (the process is still alive)."""

    def __init__(self, failure: EngineFailure) -> None:
        super().__init__(failure.message)
        self.failure = failure
        self.code = failure.code


class EngineLink:
    def __init__(self, ctx: zmq.asyncio.Context, runtime_dir: Path, spec: dict, *, index: int = 0,
                 start_timeout_s: float = 300.0, step_timeout_s: float = 60.0) -> None:
        self._ctx = ctx
        self.endpoint = ipc_endpoint(runtime_dir, f"engine-{index}")
        self.spec = spec  # EngineSpec fields (JSON-able), passed on the command line
        self.index = index
        self.start_timeout_s = start_timeout_s
        self.step_timeout_s = step_timeout_s
        self.proc: asyncio.subprocess.Process | None = None
        self.hello: EngineHello | None = None
        self._sock: AsyncTypedSocket | None = None
        self._peer: bytes | None = None
        self._lock = asyncio.Lock()
        self.starts = 0

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.returncode is None

    async def start(self) -> EngineHello:
        """Spawn a fresh engine process and wait for its hello."""
        await self.stop()
        sweep_stale()  # a dead engine's segments must go before the new one creates its own
        self._sock = make_router(self._ctx, self.endpoint)
        env = {k: v for k, v in os.environ.items() if k != "NOTIFY_SOCKET"}
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "loraplex.gpu_engine.engine_process", "--endpoint", self.endpoint,
            "--spec", json.dumps(self.spec), env=env, stdin=asyncio.subprocess.DEVNULL,
        )
        self.starts += 1
        log.info("engine %d started (pid %d)", self.index, self.proc.pid)
        reply = await self._receive(self.start_timeout_s)
        if isinstance(reply, EngineFailure):
            await self.stop()
            raise EngineRefused(reply)
        if not isinstance(reply, EngineHello):
            await self.stop()
            raise EngineDied(f"engine sent {reply.TYPE} instead of hello")
        self.hello = reply
        return reply

    async def call(self, order: Message, timeout_s: float | None = None) -> Message:
        """Send one order and return its reply; EngineRefused for a failure reply."""
        async with self._lock:
            if not self.alive() or self._sock is None or self._peer is None:
                raise EngineDied("engine is not running")
            await self._sock.send(order, identity=self._peer)
            reply = await self._receive(timeout_s or self.step_timeout_s)
        if isinstance(reply, EngineFailure):
            if reply.fatal:
                await self.stop()
                raise EngineDied(reply.message)
            raise EngineRefused(reply)
        return reply

    async def _receive(self, timeout_s: float) -> Message:
        if self._sock is None or self.proc is None:
            raise EngineDied("engine is not running")
        recv = asyncio.ensure_future(self._sock.recv())
        exited = asyncio.ensure_future(self.proc.wait())
        try:
            done, _ = await asyncio.wait({recv, exited}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            exited.cancel()
        if recv not in done:
            recv.cancel()
            code = self.proc.returncode
            await self.stop()
            if code is None:
                raise EngineDied(f"engine did not answer within {timeout_s:.0f} s (hung); it was stopped")
            raise EngineDied(f"engine process exited with status {code}")
        envelope = recv.result()
        self._peer = envelope.identity
        return envelope.message

    async def stop(self, grace_s: float = 5.0) -> None:
        """Ask the engine to exit, then make sure it did; close the socket."""
        proc, self.proc = self.proc, None
        if proc is not None and proc.returncode is None:
            if self._sock is not None and self._peer is not None:
                try:
                    await self._sock.send(EngineShutdown(), identity=self._peer)
                except Exception:  # the peer may already be gone; the kill below still ends it
                    pass
            try:
                await asyncio.wait_for(proc.wait(), grace_s)
            except asyncio.TimeoutError:
                proc.kill()
                await proc.wait()
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        self._peer = None

    def describe(self) -> dict:
        hello = asdict(self.hello) if self.hello is not None else {}
        return {"index": self.index, "pid": self.pid, "alive": self.alive(), "starts": self.starts,
                "device": hello.get("device"), "num_pages": hello.get("num_pages")}


def failure_code(exc: BaseException) -> str:
    return exc.code if isinstance(exc, EngineRefused) else ErrorCode.ENGINE_FAILED.value
