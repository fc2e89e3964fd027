"""The daemon's pool of CPU LoRA worker processes, one per core (Toppings §4.2).

Owns starting the workers (asyncio subprocesses pinned to free cores), their
private ROUTER socket, handing them jobs and calibration requests, pairing
replies with futures, and supervision: a worker that exits fails its jobs at
once and is restarted with backoff; one that overruns a job's longest healthy
duration, or whose heartbeat falls silent (busy or idle), is killed as stalled.
Runs in the daemon: never imports torch, never touches shared memory (jobs only
name segments).
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import os
import sys
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import zmq.asyncio

from loraplex.contracts.host import allowed_cores
from loraplex.cpu_lora.process import SINGLE_THREAD_ENV, worker_role
from loraplex.ipc.errors import ProtocolError
from loraplex.ipc.heartbeat import HEARTBEAT_FD_FLAG, HeartbeatWatch
from loraplex.ipc.protocol import (
    CpuCalibrate,
    CpuCalibration,
    CpuJobDone,
    CpuLoraJob,
    CpuWorkerFailure,
    CpuWorkerHello,
    CpuWorkerShutdown,
    Message,
)
from loraplex.ipc.runtime_dir import ipc_endpoint
from loraplex.ipc.socket_options import CHILD_LINK_LIMITS
from loraplex.ipc.sockets import AsyncTypedSocket, PeerUnavailable, make_router

log = logging.getLogger("loraplex.cpu_lora.pool")

MIN_WORKERS = 2
# With at least this many cores, the first RESERVED_CORES of them stay with the
# daemon and the engine unless the caller says otherwise.
RESERVE_FROM_CORES = 4
RESERVED_CORES = 2
STABLE_AFTER_S = 10.0  # a worker that lived this long restarts without backoff
MAX_EVENTS = 256


class CpuWorkerError(RuntimeError):
    """A job or calibration did not complete. `code`: worker_died, worker_stalled,
    unavailable, or the worker's own failure code (timeout, aborted, stale,
    invalid_job, internal)."""

    def __init__(self, index: int, code: str, message: str, job_id: int | None = None) -> None:
        super().__init__(f"cpu worker {index}: {code}: {message}")
        self.index = index
        self.code = code
        self.job_id = job_id


def default_worker_cores(num_workers: int | None = None, reserved_cores: Sequence[int] | None = None) -> list[int]:
    """The core of each worker: this process's allowed cores minus the reserved ones
    (default: the first two when four or more are allowed), one worker per core,
    at least MIN_WORKERS (cores are reused round-robin when there are fewer)."""
    allowed = allowed_cores()
    if reserved_cores is None:
        reserved_cores = allowed[:RESERVED_CORES] if len(allowed) >= RESERVE_FROM_CORES else []
    free = [c for c in allowed if c not in set(reserved_cores)] or allowed
    count = num_workers if num_workers is not None else max(MIN_WORKERS, len(free))
    if count < 1:
        raise ValueError(f"num_workers must be >= 1, got {count}")
    return [free[i % len(free)] for i in range(count)]


async def _end_process(proc: asyncio.subprocess.Process, polite_s: float, grace_s: float) -> None:
    """Wait `polite_s` for a requested exit, then SIGTERM and `grace_s`, then SIGKILL."""
    for ask, wait_s in ((None, polite_s), (proc.terminate, grace_s), (proc.kill, None)):
        if proc.returncode is not None:
            return
        if ask is not None:
            try:
                ask()
            except ProcessLookupError:
                pass
        try:
            await asyncio.wait_for(proc.wait(), wait_s)
        except asyncio.TimeoutError:
            continue


@dataclass(slots=True)
class _Pending:
    future: asyncio.Future[Any]
    budget_s: float  # how long the worker may take once this is at the head of its queue
    timer: asyncio.TimerHandle | None = None


@dataclass(slots=True)
class _Worker:
    index: int
    core: int
    proc: asyncio.subprocess.Process | None = None
    identity: bytes | None = None
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    # Job ids and calibration ids in the order the worker will answer them.
    queue: OrderedDict[tuple[str, int], _Pending] = field(default_factory=OrderedDict)
    starts: int = 0
    deaths: int = 0
    stalls: int = 0
    started_at: float = 0.0
    backoff_s: float = 0.0
    watch: asyncio.Task[None] | None = None
    restart: asyncio.Task[None] | None = None
    heartbeat: HeartbeatWatch | None = None

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.returncode is None


class CpuWorkerPool:
    """N worker processes behind one ROUTER socket in the runtime directory.

    Use: `await pool.start()`; `fut = await pool.submit(i, job)`; `await fut`
    gives CpuJobDone or raises CpuWorkerError; `await pool.stop()`.
    """

    def __init__(self, ctx: zmq.asyncio.Context, runtime_dir: str | os.PathLike[str], num_workers: int | None = None,
                 cores: Sequence[int] | None = None, *, reserved_cores: Sequence[int] | None = None,
                 endpoint_name: str = "cpu-workers", start_timeout_s: float = 60.0, stall_grace_s: float = 5.0,
                 restart_backoff_s: float = 0.2, max_backoff_s: float = 10.0,
                 heartbeat_timeout_s: float = 3.0) -> None:
        if cores is not None:
            cores = list(cores)
            if num_workers is not None and num_workers != len(cores):
                raise ValueError(f"num_workers={num_workers} but {len(cores)} cores given")
            if not cores:
                raise ValueError("cores must name at least one core")
        self.cores = cores if cores is not None else default_worker_cores(num_workers, reserved_cores)
        self._ctx = ctx
        self.endpoint = ipc_endpoint(Path(runtime_dir), endpoint_name)
        self.start_timeout_s = start_timeout_s
        self.stall_grace_s = stall_grace_s
        self.restart_backoff_s = restart_backoff_s
        self.max_backoff_s = max_backoff_s
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self._workers = [_Worker(index=i, core=c) for i, c in enumerate(self.cores)]
        self._sock: AsyncTypedSocket | None = None
        self._receiver: asyncio.Task[None] | None = None
        self._running = False
        self._ids = itertools.count(1)
        self.events: deque[tuple[float, str, int, str]] = deque(maxlen=MAX_EVENTS)

    # -- lifecycle ----------------------------------------------------------------

    @property
    def size(self) -> int:
        return len(self._workers)

    async def start(self) -> None:
        """Spawn every worker and wait for all hellos; RuntimeError (pool stopped) if any fails."""
        if self._sock is not None:
            raise RuntimeError("pool already started")
        self._sock = make_router(self._ctx, self.endpoint, limits=CHILD_LINK_LIMITS)
        self._receiver = asyncio.create_task(self._receive(self._sock), name="cpu-pool-receiver")
        try:
            for w in self._workers:
                await self._spawn(w)
            results = await asyncio.gather(*(self._await_hello(w) for w in self._workers))
            if not all(results):
                bad = [w.index for w, ok in zip(self._workers, results) if not ok]
                raise RuntimeError(f"cpu workers {bad} did not start (see their stderr)")
        except BaseException:
            await self.stop()
            raise
        self._running = True

    async def stop(self, grace_s: float = 5.0) -> None:
        """Ask every worker to exit, kill those that do not, fail what was pending."""
        self._running = False
        restarts = [w.restart for w in self._workers if w.restart is not None]
        for task in restarts:
            task.cancel()  # a spawn cancelled midway kills the half-started process
        await asyncio.gather(*restarts, return_exceptions=True)
        for w in self._workers:
            w.restart = None
        stopping = []
        for w in self._workers:
            if w.alive and self._sock is not None and w.identity is not None:
                try:
                    await self._sock.send(CpuWorkerShutdown(), identity=w.identity)
                except (PeerUnavailable, zmq.ZMQError):
                    pass  # already gone; the signals below cover a live one
            if w.proc is not None:
                # A worker inside a job reads the shutdown only after it: SIGTERM at once
                # (its wait ends within one wait slice), SIGKILL whatever is left.
                stopping.append((w.proc, 0.0 if w.queue else min(1.0, grace_s)))
        await asyncio.gather(*(_end_process(proc, polite_s, grace_s) for proc, polite_s in stopping))
        for w in self._workers:
            if w.watch is not None:
                w.watch.cancel()
                w.watch = None
            if w.heartbeat is not None:
                w.heartbeat.close()
                w.heartbeat = None
            w.ready.clear()
            w.identity = None
            self._fail_all(w, "unavailable", "the pool stopped")
        if self._receiver is not None:
            self._receiver.cancel()
            try:
                await self._receiver
            except asyncio.CancelledError:
                pass
            self._receiver = None
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    async def __aenter__(self) -> CpuWorkerPool:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # -- work ---------------------------------------------------------------------

    def is_ready(self, index: int) -> bool:
        w = self._workers[index]
        return w.ready.is_set() and w.identity is not None

    async def wait_ready(self, index: int | None = None, timeout_s: float = 30.0) -> None:
        """Wait until worker `index` (None: every worker) has said hello; TimeoutError otherwise."""
        workers = self._workers if index is None else [self._workers[index]]
        await asyncio.wait_for(asyncio.gather(*(w.ready.wait() for w in workers)), timeout_s)

    async def submit(self, index: int, job: CpuLoraJob) -> asyncio.Future[CpuJobDone]:
        """Send `job` to worker `index`; the future resolves to its CpuJobDone or raises
        CpuWorkerError. Raises CpuWorkerError(unavailable) at once if the worker is
        not running, ValueError if the job id is already pending there."""
        budget_s = job.max_duration_ms / 1e3 + self.stall_grace_s
        return await self._send(index, ("job", job.job_id), job, budget_s)

    async def run_job(self, index: int, job: CpuLoraJob) -> CpuJobDone:
        return await (await self.submit(index, job))

    async def calibrate(self, hidden: int, ranks: list[int], *, tokens: int = 256, repeats: int = 5,
                        dtype: str = "float32", index: int = 0, timeout_s: float = 300.0) -> CpuCalibration:
        """Have worker `index` measure its single-thread kernel on its core."""
        request = CpuCalibrate(request_id=next(self._ids), hidden=hidden, ranks=ranks, tokens=tokens,
                               repeats=repeats, dtype=dtype)
        return await (await self._send(index, ("calibrate", request.request_id), request, timeout_s))

    async def _send(self, index: int, key: tuple[str, int], msg: Message, budget_s: float) -> asyncio.Future[Any]:
        w = self._workers[index]
        if self._sock is None or not self.is_ready(index):
            raise CpuWorkerError(index, "unavailable", "worker is not running (starting or restarting)", key[1])
        if key in w.queue:
            raise ValueError(f"{key[0]} {key[1]} is already pending on cpu worker {index}")
        # Registered before the send, so a reply can never arrive ahead of its entry.
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        w.queue[key] = pending = _Pending(future, budget_s)
        try:
            await self._sock.send(msg, identity=w.identity)
        except PeerUnavailable as exc:
            if w.queue.get(key) is pending:
                del w.queue[key]
            future.cancel()
            raise CpuWorkerError(index, "unavailable", exc.reason, key[1]) from None
        self._arm_head(w)  # starts the clock only if this job is at the head
        return future

    # -- replies --------------------------------------------------------------------

    async def _receive(self, sock: AsyncTypedSocket) -> None:
        while True:
            try:
                envelope = await sock.recv()
            except ProtocolError as exc:
                log.warning("undecodable message from a cpu worker: %s", exc)
                continue
            except zmq.ZMQError as exc:
                if sock.closed:
                    return
                log.error("cpu pool socket error: %s", exc)
                continue
            msg = envelope.message
            if isinstance(msg, CpuWorkerHello):
                self._on_hello(envelope.identity, msg)
                continue
            w = self._worker_of(envelope.identity)
            if w is None:
                continue  # a late reply from a worker that was replaced
            if isinstance(msg, CpuJobDone):
                self._resolve(w, ("job", msg.job_id), msg)
            elif isinstance(msg, CpuCalibration):
                self._resolve(w, ("calibrate", msg.request_id), msg)
            elif isinstance(msg, CpuWorkerFailure):
                self._on_failure(w, msg)
            else:
                log.warning("cpu worker %d sent unexpected %s", w.index, msg.TYPE)

    def _worker_of(self, identity: bytes | None) -> _Worker | None:
        for w in self._workers:
            if w.identity is not None and w.identity == identity:
                return w
        return None

    def _on_hello(self, identity: bytes | None, hello: CpuWorkerHello) -> None:
        if not 0 <= hello.index < len(self._workers):
            log.warning("hello from unknown cpu worker index %d", hello.index)
            return
        w = self._workers[hello.index]
        if w.proc is None or hello.pid != w.proc.pid:
            return  # a replaced process's hello, delivered late
        w.identity = identity
        w.ready.set()
        self._event("ready", w.index, f"pid {hello.pid} core {hello.core}")

    def _resolve(self, w: _Worker, key: tuple[str, int], result: Message) -> None:
        pending = w.queue.pop(key, None)
        if pending is None:
            return  # already failed (stall) or never ours
        if pending.timer is not None:
            pending.timer.cancel()
        if not pending.future.done():
            pending.future.set_result(result)
        self._arm_head(w)

    def _on_failure(self, w: _Worker, failure: CpuWorkerFailure) -> None:
        self._event("failure", w.index, f"{failure.code}: {failure.message}")
        if failure.job_id is not None:
            key: tuple[str, int] | None = ("job", failure.job_id)
        elif failure.calibration_id is not None:
            key = ("calibrate", failure.calibration_id)
        else:
            key = None
            log.warning("cpu worker %d: %s: %s", w.index, failure.code, failure.message)
        pending = None if key is None else w.queue.pop(key, None)
        if key is not None and pending is not None:
            if pending.timer is not None:
                pending.timer.cancel()
            if not pending.future.done():
                pending.future.set_exception(CpuWorkerError(w.index, failure.code, failure.message, key[1]))
            self._arm_head(w)
        if failure.fatal:
            w.ready.clear()
            w.identity = None

    # -- supervision ----------------------------------------------------------------

    def _arm_head(self, w: _Worker) -> None:
        """The worker answers in order: only the head's clock runs, from now."""
        if not w.queue:
            return
        key, head = next(iter(w.queue.items()))
        if head.timer is None:
            loop = asyncio.get_running_loop()
            head.timer = loop.call_later(head.budget_s, self._on_stall, w, key)

    def declare_stalled(self, index: int, job_id: int) -> bool:
        """The engine gave up waiting for this job: kill and restart its worker now rather than
        at the job's own overrun deadline. False when the job already finished."""
        w = self._workers[index]
        if ("job", job_id) not in w.queue:
            return False
        self._on_stall(w, ("job", job_id))
        return True

    def _on_stall(self, w: _Worker, key: tuple[str, int]) -> None:
        pending = w.queue.pop(key, None)
        if pending is None:
            return
        w.stalls += 1
        message = f"no answer to {key[0]} {key[1]} within {pending.budget_s:.1f} s; killing pid {self._pid(w)}"
        self._event("stalled", w.index, message)
        log.error("cpu worker %d stalled: %s", w.index, message)
        if not pending.future.done():
            pending.future.set_exception(CpuWorkerError(w.index, "worker_stalled", message, key[1]))
        w.ready.clear()
        w.identity = None
        if w.proc is not None and w.proc.returncode is None:
            w.proc.kill()  # the watcher fails the rest of its queue and restarts it

    def _on_silent(self, w: _Worker, proc: asyncio.subprocess.Process, silence_s: float) -> None:
        """No heartbeat for heartbeat_timeout_s: the worker is stopped or wedged, busy or idle.
        Its jobs fail as stalled now (the engine computes those layers itself) and it is replaced."""
        if w.proc is not proc or proc.returncode is not None:
            return
        w.stalls += 1
        message = f"no heartbeat for {silence_s:.1f} s; killing pid {proc.pid}"
        self._event("stalled", w.index, message)
        log.error("cpu worker %d hung: %s", w.index, message)
        w.ready.clear()
        w.identity = None
        self._fail_all(w, "worker_stalled", message)
        proc.kill()  # SIGKILL also ends a stopped process; the watcher restarts it

    async def _spawn(self, w: _Worker) -> None:
        env = {k: v for k, v in os.environ.items() if k != "NOTIFY_SOCKET"}
        env.update(SINGLE_THREAD_ENV)
        w.ready.clear()
        w.identity = None
        if w.heartbeat is not None:
            w.heartbeat.close()
        w.heartbeat = beat = HeartbeatWatch(self.heartbeat_timeout_s)
        try:
            w.proc = proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "loraplex.cpu_lora.worker", "--role", worker_role(w.index),
                "--index", str(w.index), "--core", str(w.core), "--endpoint", self.endpoint,
                "--parent-pid", str(os.getpid()), HEARTBEAT_FD_FLAG, str(beat.child_fd), env=env,
                stdin=asyncio.subprocess.DEVNULL, pass_fds=(beat.child_fd,),
            )  # stdout and stderr are the daemon's
        except BaseException:
            beat.close()
            w.heartbeat = None
            raise
        beat.spawned()
        beat.watch(lambda silence: self._on_silent(w, proc, silence))
        w.starts += 1
        w.started_at = time.monotonic()
        self._event("started", w.index, f"pid {w.proc.pid} core {w.core}")
        w.watch = asyncio.create_task(self._watch(w, w.proc), name=f"cpu-worker-{w.index}-watch")

    async def _await_hello(self, w: _Worker) -> bool:
        """Wait for the current process's hello; kill it if it does not come in time."""
        proc = w.proc
        if proc is None:
            return False
        hello = asyncio.ensure_future(w.ready.wait())
        exited = asyncio.ensure_future(proc.wait())
        try:
            await asyncio.wait({hello, exited}, timeout=self.start_timeout_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            hello.cancel()
            exited.cancel()
        if w.ready.is_set():
            return True
        if proc.returncode is None:
            log.error("cpu worker %d (pid %d) sent no hello within %.0f s; killing it", w.index, proc.pid,
                      self.start_timeout_s)
            proc.kill()
        return False

    async def _watch(self, w: _Worker, proc: asyncio.subprocess.Process) -> None:
        code = await proc.wait()
        if w.proc is not proc:
            return
        w.deaths += 1
        w.ready.clear()
        w.identity = None
        lived = time.monotonic() - w.started_at
        self._event("exited", w.index, f"pid {proc.pid} status {code} after {lived:.1f} s")
        if self._running:
            log.error("cpu worker %d (pid %d) exited with status %s; restarting", w.index, proc.pid, code)
        self._fail_all(w, "worker_died", f"worker process {proc.pid} exited with status {code}")
        if self._running and w.restart is None:
            w.backoff_s = 0.0 if lived >= STABLE_AFTER_S else min(
                self.max_backoff_s, max(self.restart_backoff_s, 2 * w.backoff_s))
            w.restart = asyncio.create_task(self._restart(w), name=f"cpu-worker-{w.index}-restart")

    async def _restart(self, w: _Worker) -> None:
        """Respawn after the backoff until a hello arrives (the backoff doubles per failure)."""
        try:
            while self._running:
                await asyncio.sleep(w.backoff_s)
                if not self._running:
                    return
                try:
                    await self._spawn(w)
                    if await self._await_hello(w):
                        self._event("restarted", w.index, f"pid {self._pid(w)}")
                        return
                except OSError:  # fork or exec failed (limits, memory): try again later
                    log.exception("restarting cpu worker %d failed", w.index)
                w.backoff_s = min(self.max_backoff_s, max(self.restart_backoff_s, 2 * w.backoff_s))
        finally:
            if w.restart is asyncio.current_task():
                w.restart = None

    def _fail_all(self, w: _Worker, code: str, message: str) -> None:
        queue, w.queue = w.queue, OrderedDict()
        for (_, ident), pending in queue.items():
            if pending.timer is not None:
                pending.timer.cancel()
            if not pending.future.done():
                pending.future.set_exception(CpuWorkerError(w.index, code, message, ident))

    # -- introspection --------------------------------------------------------------

    @staticmethod
    def _pid(w: _Worker) -> int | None:
        return None if w.proc is None else w.proc.pid

    def _event(self, kind: str, index: int, detail: str) -> None:
        self.events.append((time.time(), kind, index, detail))

    def pid(self, index: int) -> int | None:
        return self._pid(self._workers[index])

    def describe(self) -> list[dict[str, Any]]:
        """Per worker: index, core, pid, alive, ready, starts, deaths, stalls, pending."""
        return [{"index": w.index, "core": w.core, "pid": self._pid(w), "alive": w.alive,
                 "ready": self.is_ready(w.index), "starts": w.starts, "deaths": w.deaths, "stalls": w.stalls,
                 "pending": len(w.queue)} for w in self._workers]
