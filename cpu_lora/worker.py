"""A CPU LoRA worker process (`loraplex-cpu-worker-N`): one core, one thread.

Receives jobs over a DEALER socket from the daemon's pool and, per layer and
stage, waits on the exchange's ready word (futex), computes its rows' LoRA
deltas straight from the host adapter store, writes them to the exchange and
adds to the done word. Never decides what to compute (the job says) and never
sends tensors over the socket. Dies with its parent (PDEATHSIG); heartbeats to
the pool over an inherited pipe.

Run as `python -m loraplex.cpu_lora.worker --role loraplex-cpu-worker-N
--index N --core C --endpoint ipc://...` (the pool does this).
"""
from __future__ import annotations

import os

from loraplex.cpu_lora.process import ROLE_PREFIX, SINGLE_THREAD_ENV, worker_comm, worker_role
from loraplex.lifetime import die_with_parent

# Before torch (and its OpenMP / MKL) is imported, so no thread pool is ever sized
# for the whole machine.
os.environ.update(SINGLE_THREAD_ENV)

import argparse  # noqa: E402
import errno  # noqa: E402
import logging  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from collections import OrderedDict  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from enum import Enum  # noqa: E402

import torch  # noqa: E402
import zmq  # noqa: E402

from loraplex import _C  # noqa: E402
from loraplex.cpu_lora import calibration  # noqa: E402
from loraplex.cpu_lora.compute import lora_delta  # noqa: E402
from loraplex.cpu_lora.views import ExchangeViews, StoreViews  # noqa: E402
from loraplex.ipc.errors import ProtocolError  # noqa: E402
from loraplex.ipc.exchange import MODULE_STAGE, STAGES, ExchangeLayout  # noqa: E402
from loraplex.ipc.heartbeat import HEARTBEAT_FD_FLAG, start_beating  # noqa: E402
from loraplex.ipc.protocol import (  # noqa: E402
    CpuCalibrate,
    CpuCalibration,
    CpuJobDone,
    CpuLoraJob,
    CpuWorkerFailure,
    CpuWorkerHello,
    CpuWorkerShutdown,
    Message,
)
from loraplex.ipc.shm import ShmError  # noqa: E402
from loraplex.ipc.socket_options import CHILD_LINK_LIMITS  # noqa: E402
from loraplex.ipc.sockets import TypedSocket, make_dealer  # noqa: E402

log = logging.getLogger("loraplex.cpu_lora.worker")

# A wait on a ready word sleeps at most this long before it looks at the control
# (abort) word again; also bounds how late a SIGTERM is noticed.
WAIT_SLICE_MS = 10.0
MAX_ATTACHED = 8  # segments of each kind kept mapped (one per engine, normally)


class WaitResult(Enum):
    READY = "ready"
    TIMEOUT = "timeout"
    ABORTED = "aborted"
    STALE = "stale"


@dataclass(slots=True)
class ModuleOp:
    """One target module of one slice at one layer: out[rows] = s·(x[rows] Aᵀ) Bᵀ."""

    x: torch.Tensor  # [count, in] rows of the stage's x region
    a: torch.Tensor  # [r, in] in the store
    bt: torch.Tensor  # [r, out] in the store
    scaling: float
    out: torch.Tensor  # [count, out] rows of the module's out region


class JobAborted(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


def wait_ready(words: memoryview, layout: ExchangeLayout, site: int, seq: int, generation: int,
               timeout_ms: float) -> WaitResult:
    """Wait until ready[site] reaches `seq`, the control word leaves `generation`, or the deadline."""
    ready = layout.ready_word(site)
    control = layout.control_word
    deadline = time.monotonic() + timeout_ms / 1e3
    while True:
        value = _C.atomic_load(words, ready)
        if value >= seq:
            # A larger value means a later step already reused the site: our step is gone.
            return WaitResult.READY if value == seq else WaitResult.STALE
        if _C.atomic_load(words, control) != generation:
            return WaitResult.ABORTED
        remaining_ms = (deadline - time.monotonic()) * 1e3
        if remaining_ms <= 0:
            return WaitResult.TIMEOUT
        _C.wait_until_at_least(words, ready, seq, min(remaining_ms, WAIT_SLICE_MS))


class CpuWorker:
    """Runs jobs and calibrations; keeps the segments it attached mapped between jobs."""

    def __init__(self, index: int, core: int) -> None:
        self.index = index
        self.core = core
        self._exchanges: OrderedDict[str, ExchangeViews] = OrderedDict()
        self._stores: OrderedDict[str, StoreViews] = OrderedDict()

    # -- segments -------------------------------------------------------------

    def exchange(self, layout: ExchangeLayout) -> ExchangeViews:
        views = self._exchanges.get(layout.segment_name)
        if views is not None and (views.layout != layout or not views.current()):
            self._exchanges.pop(layout.segment_name).close()
            views = None
        if views is None:
            views = ExchangeViews(layout)
            self._exchanges[layout.segment_name] = views
            if len(self._exchanges) > MAX_ATTACHED:
                self._exchanges.popitem(last=False)[1].close()
        self._exchanges.move_to_end(layout.segment_name)
        return views

    def store(self, name: str) -> StoreViews:
        views = self._stores.get(name)
        if views is not None and not views.current():
            self._stores.pop(name).close()
            views = None
        if views is None:
            views = StoreViews(name)
            self._stores[name] = views
            if len(self._stores) > MAX_ATTACHED:
                self._stores.popitem(last=False)[1].close()
        self._stores.move_to_end(name)
        return views

    def close(self) -> None:
        for views in [*self._exchanges.values(), *self._stores.values()]:
            views.close()
        self._exchanges.clear()
        self._stores.clear()

    # -- jobs -----------------------------------------------------------------

    @staticmethod
    def check_bounds(job: CpuLoraJob, store: StoreViews) -> None:
        """ShmError unless every slice's entry lies inside the store segment, so a bad
        offset fails the job before any done word moves."""
        for piece in job.slices:
            entry = piece.entry
            start = job.arena_base + entry.offset
            if start % 64 or start + entry.nbytes > store.size:
                raise ShmError(errno.EINVAL, f"adapter {entry.name!r} at bytes [{start}, {start + entry.nbytes}) "
                                             f"is misaligned or outside store {store.name} ({store.size} bytes)")

    @staticmethod
    def layer_ops(job: CpuLoraJob, layer: int, ex: ExchangeViews, store: StoreViews) -> list[list[ModuleOp]]:
        """ops[stage]: every (slice, target module) of `layer`, as views (no copies)."""
        ops: list[list[ModuleOp]] = [[] for _ in STAGES]
        for piece in job.slices:
            if piece.cpu_layers is not None and layer >= piece.cpu_layers:
                continue  # these rows are back on the GPU path from here on
            entry = piece.entry
            rows = slice(piece.token_start, piece.token_end)
            for module in entry.staged_modules:
                stage = MODULE_STAGE[module.name]
                a = store.block(job.arena_base + entry.a_offset(layer, module.name), entry.rank,
                                module.in_features, entry.dtype)
                bt = store.block(job.arena_base + entry.b_offset(layer, module.name), entry.rank,
                                 module.out_features, entry.dtype)
                ops[stage].append(ModuleOp(ex.x[stage][rows], a, bt, piece.scaling, ex.out[module.name][rows]))
        return ops

    def run_job(self, job: CpuLoraJob) -> Message:
        try:
            ex = self.exchange(job.exchange)
            store = self.store(job.store)
            self.check_bounds(job, store)
        except (OSError, ValueError) as exc:  # ShmError included: missing, foreign or too small segments
            return CpuWorkerFailure(index=self.index, code="invalid_job", message=str(exc), job_id=job.job_id)
        layout, words = job.exchange, ex.words
        generation = job.generation if job.generation is not None else _C.atomic_load(words, layout.control_word)
        busy = waited = 0.0
        sites = 0
        try:
            for layer in job.layers:
                # Views for this layer are made before its first wait, overlapping the engine's work.
                ops = self.layer_ops(job, layer, ex, store)
                for stage in range(len(STAGES)):
                    site = layout.site(layer, stage)
                    timeout = job.start_deadline_ms if sites == 0 else job.deadline_ms
                    started = time.perf_counter()
                    result = wait_ready(words, layout, site, job.seq, generation, timeout)
                    computing = time.perf_counter()
                    waited += computing - started
                    if result is not WaitResult.READY:
                        raise JobAborted(result.value, f"site {site} (layer {layer}, {STAGES[stage]}): "
                                         f"{result.value} waiting for seq {job.seq}")
                    for op in ops[stage]:
                        lora_delta(op.x, op.a, op.bt, op.scaling, op.out)
                    # Last look before counting: a step abandoned while we computed must
                    # not receive our completion (its site may already serve the next step).
                    if _C.atomic_load(words, layout.control_word) != generation:
                        raise JobAborted("aborted", f"step {job.seq} abandoned during site {site}")
                    _C.add_and_wake(words, layout.done_word(site), 1)
                    busy += time.perf_counter() - computing
                    sites += 1
        except JobAborted as exc:
            return CpuWorkerFailure(index=self.index, code=exc.code, message=str(exc), job_id=job.job_id)
        return CpuJobDone(job_id=job.job_id, index=self.index, busy_ms=busy * 1e3, tokens=job.tokens,
                          wait_ms=waited * 1e3, sites=sites)

    def calibrate(self, msg: CpuCalibrate) -> CpuCalibration:
        rates = calibration.measure(msg.hidden, msg.ranks, tokens=msg.tokens, repeats=msg.repeats, dtype=msg.dtype)
        return CpuCalibration(request_id=msg.request_id, index=self.index, hidden=msg.hidden, tokens=msg.tokens,
                              ranks=list(msg.ranks), tokens_per_s=rates, dtype=msg.dtype,
                              cpu_model=calibration.cpu_model_name(), torch_version=calibration.torch_version())

    def handle(self, msg: Message) -> Message | None:
        if isinstance(msg, CpuLoraJob):
            return self.run_job(msg)
        if isinstance(msg, CpuCalibrate):
            return self.calibrate(msg)
        return CpuWorkerFailure(index=self.index, code="invalid_job", message=f"a CPU worker cannot handle {msg.TYPE}")

    def serve(self, sock: TypedSocket) -> None:
        sock.send(CpuWorkerHello(index=self.index, pid=os.getpid(), core=self.core,
                                 torch_threads=torch.get_num_threads()))
        while True:
            try:
                msg = sock.recv().message
            except ProtocolError as exc:
                log.warning("undecodable message from the pool: %s", exc)
                continue
            if isinstance(msg, CpuWorkerShutdown):
                return
            try:
                reply = self.handle(msg)
            except Exception as exc:  # report and keep serving; the next job starts clean
                log.error("worker %d failed on %s: %s", self.index, msg.TYPE, traceback.format_exc())
                reply = CpuWorkerFailure(index=self.index, code="internal", message=f"{type(exc).__name__}: {exc}",
                                         job_id=msg.job_id if isinstance(msg, CpuLoraJob) else None,
                                         calibration_id=msg.request_id if isinstance(msg, CpuCalibrate) else None)
            if reply is not None:
                sock.send(reply)


def pin_to_core(core: int) -> bool:
    """Pin this process to `core`; False (and a warning) where the core is not ours."""
    try:
        os.sched_setaffinity(0, {core})
    except (OSError, AttributeError) as exc:
        log.warning("cannot pin to core %d (%s); running unpinned", core, exc)
        return False
    return True


def single_thread_torch() -> None:
    torch.set_num_threads(1)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:
        pass  # already fixed by the environment (the inter-op pool started)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=ROLE_PREFIX, description="loraplex CPU LoRA worker (started by the daemon)")
    parser.add_argument("--role", help="the role name shown in ps (loraplex-cpu-worker-N)")
    parser.add_argument("--index", type=int, required=True)
    parser.add_argument("--core", type=int, required=True)
    parser.add_argument("--endpoint", required=True, help="the pool's ROUTER endpoint")
    parser.add_argument("--parent-pid", type=int, default=0, help="exit at once if the parent is already gone")
    parser.add_argument(HEARTBEAT_FD_FLAG, type=int, default=None, help="pipe to write heartbeats to (inherited)")
    args = parser.parse_args(argv)
    role = args.role or worker_role(args.index)
    logging.basicConfig(level=logging.INFO, format=f"{role} %(levelname)s %(message)s", stream=sys.stderr)
    die_with_parent(worker_comm(args.index))
    if args.parent_pid and os.getppid() != args.parent_pid:
        return 1  # the parent died before PDEATHSIG was armed
    if args.heartbeat_fd is not None:
        start_beating(args.heartbeat_fd)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the daemon, which stops us
    pin_to_core(args.core)
    single_thread_torch()
    ctx = zmq.Context()
    sock = make_dealer(ctx, args.endpoint, limits=CHILD_LINK_LIMITS)
    worker = CpuWorker(args.index, args.core)
    try:
        worker.serve(sock)
        return 0
    finally:
        worker.close()
        sock.close()
        ctx.term()


if __name__ == "__main__":
    raise SystemExit(main())
