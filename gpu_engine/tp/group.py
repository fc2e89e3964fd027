"""The ranks of one tensor-parallel engine as processes: rank 0 (the engine process
the daemon started) starts ranks 1..N-1 as its own children, all join one process
group, and a rank that dies takes the whole engine down.

Rendezvous: a FileStore in a private directory rank 0 creates (mode 0700: no port to
race for, none another user or host could reach; torch's TCPStore listens on every
interface) and removes once every rank has joined; the others get its path on their
command line with the engine spec. The model's collectives run in the default group
(gloo on CPU, NCCL on CUDA) with a short timeout, their sockets on loopback; orders
travel over a gloo control group (gpu_engine/tp/control.py).

Dying together: every other rank dies with rank 0 (PDEATHSIG); rank 0 watches its
children's pidfds and their heartbeats (a byte every 0.5 s on a pipe, from a thread: a
stopped rank, or one stuck holding the GIL, falls silent) and exits at once when one
ends unasked or, once the group serves, stays silent RANK_HEARTBEAT_TIMEOUT_S, so the
daemon's link sees its engine exit and restarts the whole group, recomputing its
requests. The model group's timeout is the last backstop for a rank that hangs in a
collective while still beating.
"""
from __future__ import annotations

import datetime
import logging
import os
import select
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from loraplex.contracts.engine_spec import EngineSpec
from loraplex.gpu_engine.tp.comm import TpComm
from loraplex.gpu_engine.tp.control import ControlChannel
from loraplex.ipc.heartbeat import BEAT_INTERVAL_S, HEARTBEAT_FD_FLAG
from loraplex.ipc.protocol import EngineShutdown, Message
from loraplex.ipc.shm import unlink_owned

log = logging.getLogger("loraplex-engine")
WORKER_MODULE = "loraplex.gpu_engine.tp.worker"
LOOPBACK_IFNAME = "lo"
MODEL_TIMEOUT_S = 30.0  # one collective of a step: a rank silent this long is hung (the backstop)
START_TIMEOUT_S = 180.0  # every rank joined: includes their imports on a loaded host
RANK_DIED_EXIT = 3  # rank 0's exit status when another rank died under it (or went silent)
# A serving rank silent this long (beating every BEAT_INTERVAL_S) is stopped or wedged: the engine goes
# down. The daemon's own default for its children (server.heartbeat_timeout_s). Until rank 0 says the
# group serves (RankGroup.serving), START_TIMEOUT_S: joining and loading may hold a rank's GIL for seconds
# (a CUDA context, a shard's load), and the daemon's start timeout covers that phase.
RANK_HEARTBEAT_TIMEOUT_S = 3.0
STOP_GRACE_S = 10.0


@dataclass(frozen=True, slots=True)
class RankArgs:
    """What a rank other than 0 is started with (its command line)."""

    spec: EngineSpec
    rank: int
    world_size: int
    store_file: str
    parent_pid: int
    demo: bool  # serving the built-in demo model: its adapters are allowed too
    heartbeat_fd: int | None = None  # the write end of its heartbeat pipe to rank 0 (inherited)

    def argv(self) -> list[str]:
        beat = [] if self.heartbeat_fd is None else [HEARTBEAT_FD_FLAG, str(self.heartbeat_fd)]
        return [sys.executable, "-m", WORKER_MODULE, "--spec", self.spec.to_json(), "--rank", str(self.rank),
                "--world-size", str(self.world_size), "--store-file", self.store_file,
                "--parent-pid", str(self.parent_pid)] + beat + (["--demo"] if self.demo else [])


@dataclass(frozen=True, slots=True)
class RankLink:
    """One rank's membership: the model's collectives and the control channel."""

    comm: TpComm
    control: ControlChannel


def join(rank: int, world_size: int, store: dist.Store, device: str) -> RankLink:
    """Join the group (every rank; `device`: this rank's, resolved): the model's group (NCCL on
    CUDA, gloo on CPU) and the control channel."""
    # Ranks of one engine share a host: keep gloo's pair sockets and NCCL's bootstrap on loopback
    # (by default they bind the interface the hostname resolves to, which may face the network).
    for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        os.environ.setdefault(var, LOOPBACK_IFNAME)
    if device.startswith("cuda"):
        backend = "nccl"
        torch.cuda.set_device(torch.device(device))
    else:
        backend = "gloo"  # each rank's torch threads: build_runtime (model.cpu_threads, its share when auto)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=MODEL_TIMEOUT_S))
    comm = TpComm(rank, world_size, dist.group.WORLD)
    control = ControlChannel.create(rank, world_size)
    control.min_int(0)  # every rank has made every group: the store is not needed again
    return RankLink(comm, control)


def open_store(path: str, world_size: int) -> dist.Store:
    """The rendezvous store at `path` (rank 0 made its directory), waiting START_TIMEOUT_S for the ranks."""
    store = dist.FileStore(path, world_size)
    store.set_timeout(datetime.timedelta(seconds=START_TIMEOUT_S))
    return store


class RankGroup:
    """Rank 0's side: the other ranks it started, the group, and the watch on their lives."""

    def __init__(self, procs: list[subprocess.Popen], watcher: _Watcher, link: RankLink) -> None:
        self.procs = procs
        self.watcher = watcher
        self.link = link
        self.control = link.control
        self.world_size = link.comm.world_size

    @classmethod
    def start(cls, spec: EngineSpec, *, demo: bool) -> RankGroup:
        """Start ranks 1..N-1 (children of this process), join them, and watch them. spec: resolved
        for rank 0 (runtime.resolve_spec); each rank resolves its own device from it."""
        n = spec.tensor_parallel_size
        private = tempfile.mkdtemp(prefix="loraplex-tp-")  # 0700
        path = os.path.join(private, "rendezvous")
        procs: list[subprocess.Popen] = []
        beats: list[int] = []  # the read ends of the ranks' heartbeat pipes
        watcher = None
        try:
            store = open_store(path, n)
            for rank in range(1, n):
                read_fd, write_fd = os.pipe()
                beats.append(read_fd)
                try:
                    args = RankArgs(spec, rank, n, path, os.getpid(), demo, heartbeat_fd=write_fd)
                    procs.append(subprocess.Popen(args.argv(), stdin=subprocess.DEVNULL, pass_fds=(write_fd,)))
                finally:
                    os.close(write_fd)  # the rank holds it now: its exit closes the pipe
            watcher = _Watcher(procs, beats)  # watching already: a rank dying before it joined ends the start too
            return cls(procs, watcher, join(0, n, store, spec.device))
        except BaseException:
            if watcher is not None:
                watcher.stopping.set()
            else:
                for fd in beats:
                    os.close(fd)
            for proc in procs:
                proc.kill()
            raise
        finally:
            shutil.rmtree(private, ignore_errors=True)

    def serving(self) -> None:
        """Every rank has built its runtime: from now on a rank silent RANK_HEARTBEAT_TIMEOUT_S is stopped."""
        self.watcher.timeout_s = RANK_HEARTBEAT_TIMEOUT_S

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def share(self, msg: Message) -> None:
        self.control.share(msg)

    def kill(self) -> None:
        """End the other ranks at once (a failed start, a broken group): they own nothing to clean up."""
        self.watcher.stopping.set()
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()

    def close(self) -> None:
        """Tell the other ranks to exit and wait for them (a clean stop: not a death)."""
        self.watcher.stopping.set()
        try:
            self.control.share(EngineShutdown())
        except Exception as exc:  # a broken group: they are killed below
            log.warning("could not tell the other ranks to stop: %s", exc)
        for proc in self.procs:
            try:
                proc.wait(STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.link.comm.close()


class _Watcher:
    """A thread on the other ranks' pidfds and heartbeat pipes: one that exits unless the group is
    stopping, or falls silent for `timeout_s` after its first beat (SIGSTOPped, or stuck holding the
    GIL), takes rank 0 down at once (exit status RANK_DIED_EXIT), so nothing waits on it."""

    def __init__(self, procs: list[subprocess.Popen], beats: list[int], timeout_s: float = START_TIMEOUT_S) -> None:
        self.procs = procs
        self.stopping = threading.Event()
        self.timeout_s = timeout_s
        self.fds = {os.pidfd_open(p.pid): (rank, p) for rank, p in enumerate(procs, start=1)}
        self.beats = {fd: rank for rank, fd in enumerate(beats, start=1)}
        for fd in beats:
            os.set_blocking(fd, False)
        self.last_beat: dict[int, float] = {}  # rank -> monotonic time of its last byte; absent before the first
        threading.Thread(target=self._watch, name="tp-rank-watch", daemon=True).start()

    def _watch(self) -> None:
        while True:  # timeout_s may change (RankGroup.serving): read it each round
            readable, _, _ = select.select([*self.fds, *self.beats], [], [], BEAT_INTERVAL_S)
            if self.stopping.is_set():
                return
            now = time.monotonic()
            for fd in readable:
                if fd in self.fds:
                    rank, proc = self.fds[fd]
                    self._fail(f"tensor-parallel rank {rank} (pid {proc.pid}) exited with status {proc.wait()}")
                if fd in self.beats:
                    self._drain(fd, now)
            for rank, last in self.last_beat.items():
                if now - last > self.timeout_s:
                    proc = self.procs[rank - 1]
                    self._fail(f"tensor-parallel rank {rank} (pid {proc.pid}) sent no heartbeat for "
                               f"{now - last:.1f} s (stopped or hung)")

    def _drain(self, fd: int, now: float) -> None:
        try:
            data = os.read(fd, 4096)
        except BlockingIOError:
            return
        if data:
            self.last_beat[self.beats[fd]] = now
        else:  # EOF: the rank exited (its pidfd says how) or closed the pipe; either way its beats are over
            del self.beats[fd]
            os.close(fd)

    def _fail(self, why: str) -> None:
        log.error("%s: the engine goes down with it", why)
        for other in self.procs:
            if other.poll() is None:
                other.kill()
        unlink_owned()
        os._exit(RANK_DIED_EXIT)
