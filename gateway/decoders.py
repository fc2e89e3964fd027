"""The gateway's body decoder processes (gateway/json_worker.py): started with the first large
body, one body at a time each, replaced when one dies. The event loop only writes the body to
a pipe and reads back msgpack, which unpacks several times faster than JSON parses.

Owns those child processes and nothing else; a request cancelled mid-exchange still completes
it in the background, so a worker's pipe never holds half an answer.
"""
from __future__ import annotations

import asyncio
import logging
import os
import sys
from typing import Any

from loraplex.gateway.errors import ApiError
from loraplex.gateway.json_decode import Refusal
from loraplex.gateway.json_worker import HEADER_BYTES, length_prefix, pack, unpack

log = logging.getLogger("loraplex.gateway")
DECODE_WORKERS = max(1, min(2, (os.cpu_count() or 2) // 2))  # parse time is not the engine's
STOP_TIMEOUT_S = 2.0


class _Worker:
    """One decoder process and its two pipes."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc

    async def exchange(self, endpoint: str, context: int | None, body: bytes | bytearray) -> Any:
        """The JSON (the endpoint's parser accepted it) or the Refusal."""
        stdin, stdout = self.proc.stdin, self.proc.stdout
        if stdin is None or stdout is None:
            raise OSError("the decoder's pipes are closed")
        request = pack([endpoint, context])
        stdin.write(length_prefix(request) + request + length_prefix(body))
        stdin.write(body)
        await stdin.drain()
        size = int.from_bytes(await stdout.readexactly(HEADER_BYTES), "big")
        reply = unpack(await stdout.readexactly(size))
        return reply[1] if reply[0] == 0 else Refusal(*reply[1:])


class Decoders:
    """Up to DECODE_WORKERS decoder processes; each large body waits for an idle one."""

    def __init__(self, workers: int = DECODE_WORKERS) -> None:
        self._free = asyncio.Semaphore(workers)
        self._idle: list[_Worker] = []
        self._all: set[_Worker] = set()

    async def decode(self, endpoint: str, context: int | None, body: bytes | bytearray) -> Any:
        """The body's JSON once its endpoint's parser accepted it in a worker, or the Refusal."""
        await self._free.acquire()
        try:
            worker = self._idle.pop() if self._idle else await self._start()
        except BaseException:
            self._free.release()
            raise
        # Shielded: a client that goes away must not leave half an answer in the worker's pipe;
        # the exchange frees its worker (and its place) when it is done, whoever still waits.
        return await asyncio.shield(asyncio.ensure_future(self._exchange(worker, endpoint, context, body)))

    async def _exchange(self, worker: _Worker, endpoint: str, context: int | None, body: bytes | bytearray) -> Any:
        try:
            result = await worker.exchange(endpoint, context, body)
        except (OSError, EOFError, ValueError, TypeError, IndexError) as exc:  # it died, or wrote nonsense
            log.error("a body decoder process failed on a %d-byte body (%r, exit status %s); starting another",
                      len(body), exc, worker.proc.returncode)
            await self._stop(worker)
            raise ApiError(503, "the gateway's body decoder failed; try again", code="unavailable") from None
        finally:
            self._free.release()
        self._idle.append(worker)
        return result

    async def _start(self) -> _Worker:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "loraplex.gateway.json_worker", stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE, stderr=None)
        worker = _Worker(proc)
        self._all.add(worker)
        return worker

    async def _stop(self, worker: _Worker) -> None:
        self._all.discard(worker)
        if worker in self._idle:
            self._idle.remove(worker)
        proc = worker.proc
        if proc.returncode is None:
            if proc.stdin is not None:
                proc.stdin.close()  # the worker exits at end of input
            try:
                await asyncio.wait_for(proc.wait(), STOP_TIMEOUT_S)
            except asyncio.TimeoutError:
                proc.kill()
                await proc.wait()

    async def close(self) -> None:
        await asyncio.gather(*(self._stop(w) for w in list(self._all)), return_exceptions=True)
