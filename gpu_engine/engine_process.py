"""The engine process (`loraplex-engine`): a synchronous loop that executes
the daemon's orders (step plans, adapter loads) over one DEALER socket; what each
order does is gpu_engine/engine_orders.py.

It makes no policy decision. It dies with its parent (PDEATHSIG), names its
role in its command line and process name, heartbeats to the daemon over an
inherited pipe, and reports every failure it can survive as an
`engine_failure` reply instead of exiting (out of memory: code `overloaded`).

Tensor-parallel (spec.tensor_parallel_size N > 1): this process is rank 0; it starts
ranks 1..N-1 (gpu_engine/tp/group.py), shares every order it runs with them (a step
once expanded and fed, so every rank runs the same plan), and alone samples and replies.
"""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

import torch

from loraplex.contracts.engine_spec import EngineSpec, LoadMode
from loraplex.contracts.tensor_parallel import TensorParallelPlan
from loraplex.gpu_engine.child_process import run_child
from loraplex.gpu_engine.engine_orders import EngineOrders
from loraplex.gpu_engine.faults import install_faults
from loraplex.gpu_engine.malloc_arenas import bound_malloc_arenas
from loraplex.gpu_engine.model.config import ModelConfig
from loraplex.gpu_engine.pool import kv_window
from loraplex.gpu_engine.runtime import EngineRuntime, build_runtime, resolve_spec
from loraplex.gpu_engine.tp.group import RankGroup
from loraplex.ipc.engine_plan import StepPlan
from loraplex.ipc.errors import ErrorCode
from loraplex.ipc.order_pump import OrderPump
from loraplex.ipc.plan_delta import PlanBook
from loraplex.ipc.protocol import (
    EngineFailure,
    EngineHello,
    EngineLoadAdapter,
    EngineStep,
    EngineStepDelta,
    EngineStepDone,
    EngineUnloadAdapter,
    Message,
)
from loraplex.ipc.sockets import TypedSocket

ROLE = "loraplex-engine"
log = logging.getLogger(ROLE)


class CpuAssistResources:
    """The shared-memory side of cpu_assist: the exchange, owned (and unlinked) here, and the host
    store: the cache manager's when the daemon runs one (spec.host_store_segment), else our own."""

    def __init__(self, runtime: EngineRuntime) -> None:
        from loraplex.gpu_engine.cpu_assist import CpuAssistEngine
        from loraplex.gpu_engine.host_store import HostStore
        from loraplex.ipc.shm import segment_name

        spec, cfg = runtime.spec, runtime.config
        instance = spec.shm_instance or f"e{os.getpid()}"
        self.store = None if spec.host_store_segment else HostStore(
            segment_name(instance, "store"), spec.host_store_bytes, runtime.executor.pool.data.dtype,
            pin=runtime.executor.device.type == "cuda")
        try:
            self.assist = CpuAssistEngine(segment_name(instance, "xchg0"), num_layers=cfg.num_layers,
                                          module_shapes=cfg.module_shapes(), max_tokens=spec.exchange_max_tokens,
                                          cuda=runtime.executor.device.type == "cuda")
        except BaseException:
            if self.store is not None:
                self.store.close()
            raise
        runtime.executor.cpu_assist = self.assist

    def close(self) -> None:
        self.assist.close()
        if self.store is not None:
            self.store.close()


def measure_link_bytes_per_s(runtime: EngineRuntime) -> float:
    """Host -> pool copy bandwidth: pinned H2D on CUDA; the throttle or a memcpy on CPU."""
    if runtime.spec.load_throttle_bytes_s:
        return float(runtime.spec.load_throttle_bytes_s)
    device = runtime.executor.device
    nbytes = 64 << 20
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst.copy_(src, non_blocking=True)  # warm-up
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    started = time.perf_counter()
    for _ in range(3):
        dst.copy_(src, non_blocking=True)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return 3 * nbytes / (time.perf_counter() - started)


def demo_adapter_dirs(demo: bool) -> dict[str, str]:
    """The built-in demo's adapters (name -> directory) when serving it, else none."""
    if not demo:
        return {}
    from loraplex.gpu_engine.demo import builtin_demo

    return {name: str(path) for name, path in builtin_demo().adapters.items()}


def hello_for(runtime: EngineRuntime, demo_adapters: dict[str, str],
              resources: CpuAssistResources | None = None, group: RankGroup | None = None) -> EngineHello:
    cfg = runtime.config
    return EngineHello(
        pid=os.getpid(), model_dir=str(runtime.model_dir), device=runtime.spec.device, dtype=runtime.spec.dtype,
        vocab_size=cfg.vocab_size, num_layers=cfg.num_layers, hidden_size=cfg.hidden_size, kv_dim=cfg.kv_dim,
        max_model_len=runtime.max_model_len, num_pages=runtime.num_pages, page_tokens=runtime.geometry.page_tokens,
        page_elems=runtime.geometry.page_elems, eos_token_ids=list(cfg.eos_token_ids),
        bos_token_id=cfg.bos_token_id, lora_backend=runtime.spec.lora_backend, demo_adapters=demo_adapters,
        load_mode=runtime.spec.adapter_load_mode, link_bytes_per_s=measure_link_bytes_per_s(runtime),
        store_segment=(resources.store.name if resources.store else runtime.spec.host_store_segment)
        if resources else "",
        exchange=resources.assist.layout if resources else None,
        tensor_parallel_size=runtime.executor.split.world_size, cpu_threads=runtime.spec.cpu_threads,
        rank_pids=group.pids if group is not None else [],
        kv_window=kv_window(cfg.layer_windows), **runtime.executor.graph_info.as_dict(),
    )


@dataclass(frozen=True, slots=True)
class ExpandedStep:
    """A step delta expanded on the pump's thread, its sampled tokens not yet fed; `dropped`:
    the rows it left out of the batch (their sampling state is dropped on the main thread)."""
    plan: StepPlan
    dropped: list[str]


def _refused_plan(step_id: int, exc: Exception) -> EngineFailure:
    return EngineFailure(code=ErrorCode.ENGINE_FAILED.value, message=f"step plan refused: {exc}", subject=str(step_id))


class EngineServer:
    def __init__(self, runtime: EngineRuntime, sock: TypedSocket, *, demo: bool = False,
                 resources: CpuAssistResources | None = None, group: RankGroup | None = None) -> None:
        """group: the other ranks when this engine is tensor-parallel (this process is rank 0)."""
        self.runtime = runtime
        self.sock = sock
        self.resources = resources
        self.group = group
        self.demo_adapters = demo_adapter_dirs(demo)
        self.orders = EngineOrders(runtime, store=resources.store if resources is not None else None,
                                   demo_adapters=list(self.demo_adapters.values()))
        self.book = PlanBook()  # the persistent batch the daemon's step deltas refer to

    def serve(self) -> None:
        self.sock.send(hello_for(self.runtime, self.demo_adapters, self.resources, self.group))
        # Orders are received and their plans expanded on the pump's thread while a step runs.
        pump = OrderPump(self.sock, self.prepare).start()
        try:
            pump.serve(self.begin, self.handle)
        finally:
            pump.stop()

    def close(self, clean: bool) -> None:
        """clean: the daemon asked us to stop (the other ranks wait for an order); else the group
        may be mid-collective, and its other ranks are killed instead."""
        self.orders.close()
        if self.group is None:
            return
        if clean:
            self.group.close()
        else:
            self.group.kill()

    def prepare(self, msg: Message, nbytes: int = 0) -> object:
        """On the pump's thread: a step delta expanded against the persistent batch (or the
        refusal to send back); any other order as it came."""
        if isinstance(msg, EngineStepDelta):
            try:
                plan = self.book.expand(msg.delta)
                return ExpandedStep(plan, self.book.dropped)
            except ValueError as exc:  # the daemon resynchronises with the next step
                return _refused_plan(msg.delta.step_id, exc)
        return msg

    def begin(self, msg: object) -> object:
        """Just before running it: a step fed the tokens its rows sampled in the last one."""
        if isinstance(msg, EngineStepDelta):
            msg = self.prepare(msg)
        if isinstance(msg, ExpandedStep):
            try:
                self.book.feed(msg.plan)
            except ValueError as exc:
                self.book.failed()
                return _refused_plan(msg.plan.step_id, exc)
        return msg

    def handle(self, msg: object) -> Message:
        if isinstance(msg, EngineStepDelta):  # not through the pump: expand and feed it here
            msg = self.begin(msg)
        if isinstance(msg, EngineFailure):  # a plan that could not be expanded or fed
            return msg
        if isinstance(msg, ExpandedStep):
            self.runtime.executor.sampler.forget(msg.dropped)  # finished, preempted or moved: their history goes
            reply = self._step(msg.plan)
            if isinstance(reply, EngineStepDone):
                self.book.sampled(reply.result)
            else:
                self.book.failed()
            return reply
        if isinstance(msg, EngineStep):
            return self._step(msg.plan)
        if isinstance(msg, (EngineLoadAdapter, EngineUnloadAdapter)):
            return self._run(msg)
        return EngineFailure(code=ErrorCode.UNKNOWN_TYPE.value, message=f"engine cannot handle {msg.TYPE}")

    def _step(self, plan: StepPlan) -> Message:
        if self.group is None:  # one device: no order to share (and no message to build per step)
            return self.orders.step(plan)
        return self._run(EngineStep(plan=plan))  # expanded and fed: every rank runs the same plan

    def _run(self, order: Message) -> Message:
        """Run `order` here and, tensor-parallel, on every other rank: shared first, then the ranks
        agree whether it succeeded everywhere (a failure on any rank is the engine's reply)."""
        if self.group is None:
            return self.orders.run(order)
        self.group.share(order)
        reply = self.orders.run(order)
        failures = self.group.control.failures(isinstance(reply, EngineFailure))
        return self.orders.settle(order, reply, failures, 0, self.group.world_size)


def _start(spec: EngineSpec) -> tuple[EngineRuntime, CpuAssistResources | None, RankGroup | None]:
    bound_malloc_arenas()
    group = None
    if spec.tensor_parallel_size > 1:
        resolved = resolve_spec(spec)
        # before any rank starts: a model that cannot split N ways is a start failure (ConfigError)
        TensorParallelPlan.configured(ModelConfig.from_dir(resolved.model or ""), spec.tensor_parallel_size)
        group = RankGroup.start(resolved, demo=spec.model is None)
        spec = resolved
    try:
        runtime = build_runtime(spec, link=group.link if group is not None else None)
        install_faults(runtime.executor.model)  # test-only: no-op unless LORAPLEX_FAULTS is set
        resources = CpuAssistResources(runtime) if runtime.spec.adapter_load_mode == LoadMode.CPU_ASSIST else None
    except BaseException:
        if group is not None:
            group.kill()  # they may be building their runtimes: no order would reach them
        raise
    if group is not None:
        group.serving()  # every rank built its runtime: a silent one is stopped now, not slow to start
    return runtime, resources, group


def _serve(state: tuple[EngineRuntime, CpuAssistResources | None, RankGroup | None], sock: TypedSocket,
           demo: bool) -> None:
    runtime, resources, group = state
    server = EngineServer(runtime, sock, demo=demo, resources=resources, group=group)
    clean = False
    try:
        server.serve()
        clean = True
    finally:
        server.close(clean)
        if resources is not None:
            resources.close()


def main(argv: list[str] | None = None) -> int:
    return run_child(ROLE, "engine", argv, _start, _serve)


if __name__ == "__main__":
    raise SystemExit(main())
