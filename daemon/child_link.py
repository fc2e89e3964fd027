"""The daemon's side of one child process it starts from gpu_engine (an engine, the cache
manager): start it, exchange orders and replies over a private ROUTER socket, notice when it
dies or hangs. EngineLink (engine_link.py) and CacheManagerLink (cache_link.py) say which child.

The child is a synchronous executor, so replies pair with orders by order. `call` sends one
order and waits for its reply; the step loop may instead `submit` step orders ahead and
`collect` their replies in order (scheduler.overlap), and a `call` then waits until every
submitted order was collected (`callers` tells the step loop to let it through).
Every wait also watches the process: a dead or silent child raises
EngineDied instead of hanging the daemon. The child also heartbeats over a pipe; one silent
for `heartbeat_timeout_s` (stopped, wedged) is killed at once, busy or idle, and `on_lost`
is called.

Warm spare (`spare=True`, server.spare_children): after each hello the link starts one
spare (`python -m loraplex.standby MODULE --standby ...`, see loraplex/standby.py) at low
priority; it imports torch and the child's modules and waits. A restart hands it the spec
on its stdin instead of spawning cold, which saves the imports (CPU demo: hello ~0.06 s
after a SIGKILL, not ~1.6 s). A spare that died or cannot take its spec means a cold spawn.
Trade-off: one idle process per link (~230 MB of host RAM, no device memory) for faster
recovery. A spare is watched (heartbeat) only once it is the running child; stop() kills
it. A former spare keeps `--standby` in its argv; its process name (`loraplex-spare`, then
the role) tells which it is.
"""
from __future__ import annotations

import asyncio
import logging
import os
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import zmq.asyncio

from loraplex.contracts.engine_spec import EngineSpec
from loraplex.ipc.heartbeat import HEARTBEAT_FD_FLAG, HeartbeatWatch
from loraplex.ipc.protocol import EngineFailure, EngineShutdown, Message
from loraplex.ipc.runtime_dir import ipc_endpoint
from loraplex.ipc.shm import sweep_stale
from loraplex.ipc.socket_options import CHILD_LINK_LIMITS
from loraplex.ipc.sockets import AsyncTypedSocket, make_router

log = logging.getLogger("loraplex.daemon.engine")
# Until its hello, an engine loading a model may hold the GIL for long stretches (CUDA
# context creation, weight conversion): its heartbeat may pause this long.
START_SILENCE_S = 30.0
MAKE_WAY_TURNS = 16  # event-loop turns a submit gives calls waiting for the link to take it


class EngineDied(RuntimeError):
    """The engine process exited or stopped answering."""


class EngineRefused(RuntimeError):
    """The engine answered an order with a failure (the process is still alive)."""

    def __init__(self, failure: EngineFailure) -> None:
        super().__init__(failure.message)
        self.failure = failure
        self.code = failure.code


@dataclass
class _Spare:
    """A pre-spawned child waiting for its spec on stdin, its heartbeat pipe not yet watched."""
    proc: asyncio.subprocess.Process
    beat: HeartbeatWatch


STANDBY_MODULE = "loraplex.standby"


class ChildLink:
    # What the child is: its module (run with -m), the name of its endpoint, the hello it sends.
    CHILD_MODULE: str
    ENDPOINT_NAME: str
    HELLO_TYPE: type

    def __init__(self, ctx: zmq.asyncio.Context, runtime_dir: Path, spec: EngineSpec, *, index: int = 0,
                 start_timeout_s: float = 300.0, step_timeout_s: float = 60.0,
                 heartbeat_timeout_s: float = 3.0, spare: bool = False) -> None:
        self._ctx = ctx
        self.endpoint = ipc_endpoint(runtime_dir, f"{self.ENDPOINT_NAME}-{index}")
        self.spec = spec  # built once from the configuration (LoraplexConfig.engine_spec)
        self.index = index
        self.start_timeout_s = start_timeout_s
        self.step_timeout_s = step_timeout_s  # the progress deadline of one order
        self.heartbeat_timeout_s = heartbeat_timeout_s  # the liveness deadline, busy or idle
        self.proc: asyncio.subprocess.Process | None = None
        self.hello = None  # HELLO_TYPE, once the running child said it
        self._sock: AsyncTypedSocket | None = None
        self._peer: bytes | None = None
        self._lock = asyncio.Lock()
        self.outstanding = 0  # submitted orders whose replies were not collected
        self._drained = asyncio.Event()  # set while nothing is outstanding
        self._drained.set()
        self.callers = 0  # calls waiting for the submitted orders to drain
        self._heartbeat: HeartbeatWatch | None = None
        self.lost_reason: str | None = None  # why the running engine was lost (None while it is fine)
        self._hung = False  # lost by heartbeat silence: killed, not asked to exit
        self.on_lost: Callable[[], None] | None = None  # called when the engine dies or hangs unasked
        self.starts = 0
        self.spare_enabled = spare
        self.spare_starts = 0  # spares spawned
        self.spare_handoffs = 0  # starts that used a spare instead of a cold spawn
        self._spare: _Spare | None = None
        self._spare_task: asyncio.Task | None = None
        self._exit_watch: tuple[asyncio.subprocess.Process, asyncio.Future] | None = None

    def child_spec(self) -> EngineSpec:
        """The spec this start hands the child: the configured one with what is per child and per start."""
        return self.spec

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.returncode is None and self.lost_reason is None

    @property
    def spare_pid(self) -> int | None:
        spare = self._spare
        return spare.proc.pid if spare is not None and spare.proc.returncode is None else None

    @property
    def spare_ready(self) -> bool:
        """The spare finished its imports (it said so on its heartbeat pipe) and is still there."""
        spare = self._spare
        return spare is not None and spare.proc.returncode is None and spare.beat.poll() and not spare.beat.closed

    async def start(self):
        """Start an engine process (the warm spare if there is one, else a fresh one) and wait
        for its hello; then, with spares on, spawn the next spare in the background."""
        await self._stop_child()
        sweep_stale()  # a dead engine's segments must go before the new one creates its own
        self._sock = make_router(self._ctx, self.endpoint, limits=CHILD_LINK_LIMITS)
        self.hello = None  # until this process says hello
        spare = await self._take_spare()
        if spare is not None:
            self.proc, beat = spare.proc, spare.beat
            beat.timeout_s = max(self.heartbeat_timeout_s, START_SILENCE_S)
            self.spare_handoffs += 1
        else:
            beat = HeartbeatWatch(max(self.heartbeat_timeout_s, START_SILENCE_S))
            try:
                self.proc = await asyncio.create_subprocess_exec(
                    sys.executable, "-m", self.CHILD_MODULE, "--endpoint", self.endpoint,
                    "--spec", self.child_spec().to_json(), HEARTBEAT_FD_FLAG, str(beat.child_fd), env=_child_env(),
                    stdin=asyncio.subprocess.DEVNULL, pass_fds=(beat.child_fd,),
                )
            except BaseException:
                beat.close()
                raise
            beat.spawned()
        self._heartbeat, self.lost_reason, self._hung = beat, None, False
        proc = self.proc
        beat.watch(lambda silence: self._silent(proc, silence), lambda: self._closed(proc))
        self.starts += 1
        log.info("%s %d started (pid %d%s)", self.ENDPOINT_NAME, self.index, proc.pid,
                 ", the warm spare" if spare is not None else "")
        reply = await self._receive(self.start_timeout_s)
        if isinstance(reply, EngineFailure):
            await self._stop_child()
            raise EngineRefused(reply)
        if not isinstance(reply, self.HELLO_TYPE):
            await self._stop_child()
            raise EngineDied(f"engine sent {reply.TYPE} instead of hello")
        self.hello = reply
        beat.timeout_s = self.heartbeat_timeout_s
        if self.spare_enabled and self._spare is None and (self._spare_task is None or self._spare_task.done()):
            # Only now: a spare importing torch must not compete with a starting child for the CPU.
            self._spare_task = asyncio.ensure_future(self._spawn_spare())
        return reply

    async def _spawn_spare(self) -> None:
        beat = HeartbeatWatch(self.heartbeat_timeout_s)  # watched only once the spare is the running child
        try:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", STANDBY_MODULE, self.CHILD_MODULE, "--standby", "--endpoint", self.endpoint,
                HEARTBEAT_FD_FLAG, str(beat.child_fd), env=_child_env(), stdin=asyncio.subprocess.PIPE,
                pass_fds=(beat.child_fd,),
            )
        except (OSError, ValueError) as exc:
            beat.close()
            log.warning("%s %d: cannot spawn a spare (restarts will spawn cold): %s", self.ENDPOINT_NAME,
                        self.index, exc)
            return
        beat.spawned()
        self._spare = _Spare(proc, beat)
        self.spare_starts += 1
        log.info("%s %d: warm spare pid %d", self.ENDPOINT_NAME, self.index, proc.pid)

    async def _take_spare(self) -> _Spare | None:
        """Hand the spec to the spare; None (and the spare gone) when there is none or it is unusable."""
        if self._spare_task is not None:
            await asyncio.gather(self._spare_task, return_exceptions=True)  # a spawn in flight: a fork and exec away
        spare, self._spare = self._spare, None
        if spare is None:
            return None
        stdin = spare.proc.stdin
        try:
            spare.beat.poll()  # reads EOF if it died unreaped
            if spare.proc.returncode is not None or stdin is None or spare.beat.closed:
                raise ConnectionResetError(f"it exited (status {spare.proc.returncode})")
            stdin.write(self.child_spec().to_json().encode() + b"\n")
            await stdin.drain()
            stdin.close()
        except (OSError, RuntimeError) as exc:  # RuntimeError: the transport closed under us
            log.warning("%s %d: spare pid %d unusable (%s); spawning cold", self.ENDPOINT_NAME, self.index,
                        spare.proc.pid, exc)
            await _discard(spare)
            return None
        return spare

    async def _retire_spare(self) -> None:
        task, self._spare_task = self._spare_task, None
        if task is not None:
            await asyncio.gather(task, return_exceptions=True)
        spare, self._spare = self._spare, None
        if spare is not None:
            await _discard(spare)

    def _silent(self, proc: asyncio.subprocess.Process, silence_s: float) -> None:
        """No heartbeat: the engine is stopped or wedged. SIGKILL (a stopped process ignores
        SIGTERM); the call in flight, if any, then fails with EngineDied and this reason."""
        if proc is not self.proc or proc.returncode is not None:
            return
        self.lost_reason = f"engine sent no heartbeat for {silence_s:.1f} s (hung); killed pid {proc.pid}"
        self._hung = True
        log.error("%s %d: %s", self.ENDPOINT_NAME, self.index, self.lost_reason)
        try:
            proc.kill()
        except ProcessLookupError:
            pass
        self._notify_lost()

    def _closed(self, proc: asyncio.subprocess.Process) -> None:
        """The heartbeat pipe closed: the process exited, perhaps while idle."""
        if proc is not self.proc or self.lost_reason is not None:
            return
        self.lost_reason = f"engine process {proc.pid} exited"
        self._notify_lost()

    def _notify_lost(self) -> None:
        if self.on_lost is not None:
            self.on_lost()

    async def call(self, order: Message, timeout_s: float | None = None) -> Message:
        """Send one order and return its reply; EngineRefused for a failure reply."""
        await self._lock_drained()
        try:
            self._check_running()
            await self._sock.send(order, identity=self._peer)
            reply = await self._receive(timeout_s or self.step_timeout_s)
        finally:
            self._lock.release()
        return await self._checked(reply)

    async def _lock_drained(self) -> None:
        """Take the lock with no submitted order outstanding, so that the next reply is ours.
        Counted in `callers` until then: the step loop sees it, collects what it submitted and
        submits nothing more (a submit needs the lock, which we then hold)."""
        self.callers += 1
        try:
            while True:
                await self._drained.wait()
                await self._lock.acquire()
                if not self.outstanding:
                    return
                self._lock.release()  # a submit got in between: wait for that one too
        finally:
            self.callers -= 1

    async def submit(self, order: Message) -> None:
        """Send an order without waiting for its reply; `collect` returns the replies in order.
        Calls waiting for the link with nothing outstanding go first (else a loop that drains
        and submits again without yielding could keep them waiting for ever)."""
        for _ in range(MAKE_WAY_TURNS):
            if not self.callers or self.outstanding:
                break
            await asyncio.sleep(0)  # a woken caller takes the lock within a turn or two; the lock is fair
        async with self._lock:
            self._check_running()
            await self._sock.send(order, identity=self._peer)
            self.outstanding += 1
            self._drained.clear()

    async def collect(self, timeout_s: float | None = None) -> Message:
        """The reply to the oldest submitted order; EngineRefused for a failure reply."""
        async with self._lock:
            if not self.outstanding:
                raise RuntimeError("collect() without a submitted order")
            try:
                reply = await self._receive(timeout_s or self.step_timeout_s)
            except EngineDied:
                self._forget_outstanding()
                raise
            self.outstanding -= 1
            if not self.outstanding:
                self._drained.set()
        return await self._checked(reply)

    def _forget_outstanding(self) -> None:
        self.outstanding = 0
        self._drained.set()

    def _check_running(self) -> None:
        if not self.alive() or self._sock is None or self._peer is None:
            raise EngineDied(self.lost_reason or "engine is not running")

    async def _checked(self, reply: Message) -> Message:
        if isinstance(reply, EngineFailure):
            if reply.fatal:
                await self._stop_child()
                raise EngineDied(reply.message)
            raise EngineRefused(reply)
        return reply

    async def _receive(self, timeout_s: float) -> Message:
        if self._sock is None or self.proc is None:
            raise EngineDied("engine is not running")
        recv = asyncio.ensure_future(self._sock.recv())
        done, _ = await asyncio.wait({recv, self._exited(self.proc)}, timeout=timeout_s,
                                     return_when=asyncio.FIRST_COMPLETED)
        if recv not in done:
            recv.cancel()
            code, hung = self.proc.returncode, self.lost_reason if self._hung else None
            await self._stop_child()
            if hung is not None:
                raise EngineDied(hung)
            if code is None:
                raise EngineDied(f"engine did not answer within {timeout_s:.0f} s (hung); it was stopped")
            raise EngineDied(f"engine process exited with status {code}")
        envelope = recv.result()
        self._peer = envelope.identity
        return envelope.message

    def _exited(self, proc: asyncio.subprocess.Process) -> asyncio.Future:
        """One wait() per child, shared by every order to it. A cancelled proc.wait() leaves its
        waiter in the process transport until the child exits, so a wait per step (the
        obvious way) grows the daemon by a future per step for the engine's whole life."""
        if self._exit_watch is None or self._exit_watch[0] is not proc:
            self._exit_watch = (proc, asyncio.ensure_future(proc.wait()))
        return self._exit_watch[1]

    async def stop(self, grace_s: float = 5.0) -> None:
        """Ask the engine to exit, then make sure it did; close the socket; kill the spare."""
        await self._stop_child(grace_s)
        await self._retire_spare()

    async def _stop_child(self, grace_s: float = 5.0) -> None:
        """stop() for the running child only: the spare stays for the next start."""
        self._forget_outstanding()  # a new child owes no reply to orders sent to this one
        proc, self.proc = self.proc, None
        hung, self._hung = self._hung, False
        if self._heartbeat is not None:
            self._heartbeat.close()
            self._heartbeat = None
        if proc is not None and proc.returncode is None and hung:
            try:
                proc.kill()  # stopped or wedged: it will not read a shutdown order
            except ProcessLookupError:
                pass
            await proc.wait()
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
                "ready": self.alive() and self.hello is not None,
                "device": hello.get("device"), "num_pages": hello.get("num_pages"),
                "tensor_parallel_size": hello.get("tensor_parallel_size"), "rank_pids": hello.get("rank_pids"),
                "spare_pid": self.spare_pid, "spare_ready": self.spare_ready, "spare_handoffs": self.spare_handoffs,
                "cuda_graphs": hello.get("cuda_graphs"), "graph_buckets": hello.get("graph_buckets"),
                "cpu_threads": hello.get("cpu_threads")}


def _child_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != "NOTIFY_SOCKET"}  # only the daemon talks to systemd


async def _discard(spare: _Spare) -> None:
    """Kill a spare: it holds no device memory, shared memory or socket, so SIGKILL loses nothing."""
    if spare.proc.returncode is None:
        try:
            spare.proc.kill()
        except ProcessLookupError:
            pass
    await spare.proc.wait()
    if spare.proc.stdin is not None:
        spare.proc.stdin.close()
    spare.beat.close()

