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
children's pidfds and exits at once when one ends unasked, so the daemon's link sees
its engine exit and restarts the whole group, recomputing its requests. The model
group's timeout is the backstop for a rank that hangs instead of dying.
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
from dataclasses import dataclass

import torch
import torch.distributed as dist

from loraplex.contracts.engine_spec import EngineSpec
from loraplex.gpu_engine.tp.comm import TpComm
from loraplex.gpu_engine.tp.control import ControlChannel
from loraplex.ipc.protocol import EngineShutdown, Message
from loraplex.ipc.shm import unlink_owned

log = logging.getLogger("loraplex-engine")
WORKER_MODULE = "loraplex.gpu_engine.tp.worker"
LOOPBACK_IFNAME = "lo"
MODEL_TIMEOUT_S = 30.0  # one collective of a step: a rank silent this long is hung (the backstop)
START_TIMEOUT_S = 180.0  # every rank joined: includes their imports on a loaded host
RANK_DIED_EXIT = 3  # rank 0's exit status when another rank died under it
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

    def argv(self) -> list[str]:
        return [sys.executable, "-m", WORKER_MODULE, "--spec", self.spec.to_json(), "--rank", str(self.rank),
                "--world-size", str(self.world_size), "--store-file", self.store_file,
                "--parent-pid", str(self.parent_pid)] + (["--demo"] if self.demo else [])


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
        backend = "gloo"
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))  # N ranks share the host's cores
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
        watcher = None
        try:
            store = open_store(path, n)
            for rank in range(1, n):
                args = RankArgs(spec, rank, n, path, os.getpid(), demo)
                procs.append(subprocess.Popen(args.argv(), stdin=subprocess.DEVNULL))
            watcher = _Watcher(procs)  # watching already: a rank dying before it joined ends the start too
            return cls(procs, watcher, join(0, n, store, spec.device))
        except BaseException:
            if watcher is not None:
                watcher.stopping.set()
            for proc in procs:
                proc.kill()
            raise
        finally:
            shutil.rmtree(private, ignore_errors=True)

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
    """A thread on the other ranks' pidfds: one that exits unless the group is stopping takes
    rank 0 down at once (exit status RANK_DIED_EXIT), so nothing waits on a dead rank."""

    def __init__(self, procs: list[subprocess.Popen]) -> None:
        self.procs = procs
        self.stopping = threading.Event()
        self.fds = {os.pidfd_open(p.pid): (rank, p) for rank, p in enumerate(procs, start=1)}
        threading.Thread(target=self._watch, name="tp-rank-watch", daemon=True).start()

    def _watch(self) -> None:
        readable, _, _ = select.select(list(self.fds), [], [])
        if self.stopping.is_set():
            return
        rank, proc = self.fds[readable[0]]
        log.error("tensor-parallel rank %d (pid %d) exited with status %s: the engine goes down with it",
                  rank, proc.pid, proc.wait())
        for other in self.procs:
            if other.poll() is None:
                other.kill()
        unlink_owned()
        os._exit(RANK_DIED_EXIT)
