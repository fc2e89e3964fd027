"""The engine process (`loraplex-engine`): a synchronous loop that executes
the daemon's orders (step plans, adapter loads) over one DEALER socket.

It makes no policy decision. It dies with its parent (PDEATHSIG), names its
role in its command line and process name, heartbeats to the daemon over an
inherited pipe, and reports every failure it can survive as an
`engine_failure` reply instead of exiting (out of memory: code `overloaded`).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
import os
import time
import traceback

import torch

from loraplex.contracts.geometry import AdapterLayout
from loraplex.contracts.engine_spec import EngineSpec
from loraplex.errors import LoraplexRequestError
from loraplex.gpu_engine.child_process import run_child
from loraplex.gpu_engine.faults import install_faults
from loraplex.gpu_engine.lora.peft_adapter import HostAdapter, load_peft_adapter
from loraplex.gpu_engine.malloc_arenas import bound_malloc_arenas
from loraplex.gpu_engine.runtime import EngineRuntime, build_runtime
from loraplex.gpu_engine.store_reader import StoreReader
from loraplex.ipc.adapter_files import allow_also, resolve_roots
from loraplex.ipc.engine_plan import StepPlan
from loraplex.ipc.errors import ErrorCode
from loraplex.ipc.protocol import (
    EngineAdapterLoaded,
    EngineFailure,
    EngineHello,
    EngineLoadAdapter,
    EngineStep,
    EngineStepDelta,
    EngineStepDone,
    EngineUnloadAdapter,
    Message,
)
from loraplex.ipc.order_pump import OrderPump
from loraplex.ipc.plan_delta import PlanBook
from loraplex.ipc.sockets import TypedSocket

ROLE = "loraplex-engine"
log = logging.getLogger(ROLE)
# torch.OutOfMemoryError since 2.5; torch.cuda.OutOfMemoryError (its alias now) before.
_OOM_ERRORS = (getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError), MemoryError)


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
                                          hidden=cfg.hidden_size, q_dim=cfg.q_dim, kv_dim=cfg.kv_dim,
                                          intermediate=cfg.intermediate_size, max_tokens=spec.exchange_max_tokens,
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


def hello_for(runtime: EngineRuntime, demo: bool, resources: CpuAssistResources | None = None) -> EngineHello:
    cfg = runtime.config
    demo_adapters: dict[str, str] = {}
    if demo:
        from loraplex.gpu_engine.demo import builtin_demo

        demo_adapters = {name: str(path) for name, path in builtin_demo().adapters.items()}
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
        **runtime.executor.graph_info.as_dict(),
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
                 resources: CpuAssistResources | None = None) -> None:
        self.runtime = runtime
        self.sock = sock
        self.demo = demo
        self.resources = resources
        self.stores = StoreReader(pin=runtime.executor.device.type == "cuda")  # the cache manager's store
        self.roots = resolve_roots(runtime.spec.adapter_dirs)  # where adapter files may resolve (server.adapter_dirs)
        self.book = PlanBook()  # the persistent batch the daemon's step deltas refer to

    def serve(self) -> None:
        hello = hello_for(self.runtime, self.demo, self.resources)
        self.roots = allow_also(self.roots, hello.demo_adapters.values())  # the demo's own adapters are allowed
        self.sock.send(hello)
        # Orders are received and their plans expanded on the pump's thread while a step runs.
        pump = OrderPump(self.sock, self.prepare).start()
        try:
            pump.serve(self.begin, self.handle)
        finally:
            pump.stop()

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
        executor = self.runtime.executor
        if isinstance(msg, EngineStepDelta):  # not through the pump: expand and feed it here
            msg = self.begin(msg)
        if isinstance(msg, EngineFailure):  # a plan that could not be expanded or fed
            return msg
        if isinstance(msg, ExpandedStep):
            plan = msg.plan
            executor.sampler.forget(msg.dropped)  # finished, preempted or moved: their history goes
            reply = self._step(plan)
            if isinstance(reply, EngineStepDone):
                self.book.sampled(reply.result)
            else:
                self.book.failed()
            return reply
        if isinstance(msg, EngineStep):
            return self._step(msg.plan)
        if isinstance(msg, EngineLoadAdapter):
            return self._load(msg)
        if isinstance(msg, EngineUnloadAdapter):
            executor.remove_host_adapter(msg.name)
            self.stores.forget(msg.name)
            if self.resources is not None and self.resources.store is not None:
                self.resources.store.remove(msg.name)
            return EngineAdapterLoaded(name=msg.name, rank=0, target_modules=[], num_pages=0, nbytes=0)
        return EngineFailure(code=ErrorCode.UNKNOWN_TYPE.value, message=f"engine cannot handle {msg.TYPE}")

    def _step(self, plan: StepPlan) -> Message:
        executor = self.runtime.executor
        try:
            return EngineStepDone(result=executor.execute(plan))
        except _OOM_ERRORS as exc:  # the daemon retries with a smaller batch; we stay up
            log.error("step %d ran out of memory: %s", plan.step_id, exc)
            if executor.device.type == "cuda":
                torch.cuda.empty_cache()
            return EngineFailure(code=ErrorCode.OVERLOADED.value, message=f"out of memory: {exc}",
                                 subject=str(plan.step_id))
        except Exception as exc:  # the daemon re-plans the step; the process keeps serving
            log.error("step %d failed: %s", plan.step_id, traceback.format_exc())
            return EngineFailure(code=ErrorCode.ENGINE_FAILED.value, message=f"step failed: {exc}",
                                 subject=str(plan.step_id))

    def _load(self, msg: EngineLoadAdapter) -> Message:
        executor = self.runtime.executor
        try:
            if msg.store_entry is not None:  # weights already in the cache manager's store: view them
                adapter = self.stores.adapter(msg.name, msg.path, msg.store_segment, msg.store_entry,
                                              self.runtime.config, max_lora_rank=self.runtime.spec.max_lora_rank,
                                              roots=self.roots)
            else:
                adapter = load_peft_adapter(msg.name, msg.path, self.runtime.config,
                                            max_lora_rank=self.runtime.spec.max_lora_rank,
                                            dtype=executor.pool.data.dtype, roots=self.roots)
        except LoraplexRequestError as exc:
            return EngineFailure(code=exc.code, message=str(exc), subject=msg.name)
        except OSError as exc:
            return EngineFailure(code=ErrorCode.INVALID_ADAPTER.value, message=str(exc), subject=msg.name)
        if msg.store_entry is not None:
            layout = (executor.rebind_host_adapter if msg.keep_resident else self._replace_host)(adapter)
            self.stores.bind(msg.name, msg.store_segment)
            return EngineAdapterLoaded(name=msg.name, rank=adapter.spec.rank, target_modules=list(adapter.spec.targets),
                                       num_pages=layout.num_pages, nbytes=adapter.nbytes, store_entry=msg.store_entry,
                                       scaling=adapter.spec.scaling)
        executor.remove_host_adapter(msg.name)  # a reload replaces the old weights
        self.stores.forget(msg.name)
        entry = None
        if self.resources is not None and self.resources.store is not None:
            cfg = self.runtime.config
            try:
                entry = self.resources.store.put(adapter, cfg.module_shapes(), cfg.num_layers)
            except RuntimeError as exc:
                return EngineFailure(code=ErrorCode.OVERLOADED.value, message=str(exc), subject=msg.name)
        layout = executor.add_host_adapter(adapter)
        return EngineAdapterLoaded(name=msg.name, rank=adapter.spec.rank, target_modules=list(adapter.spec.targets),
                                   num_pages=layout.num_pages, nbytes=adapter.nbytes, store_entry=entry,
                                   scaling=adapter.spec.scaling)

    def _replace_host(self, adapter: HostAdapter) -> AdapterLayout:
        self.runtime.executor.remove_host_adapter(adapter.name)  # a reload replaces the old weights
        return self.runtime.executor.add_host_adapter(adapter)


def _start(spec: EngineSpec) -> tuple[EngineRuntime, CpuAssistResources | None]:
    bound_malloc_arenas()
    runtime = build_runtime(spec)
    install_faults(runtime.executor.model)  # test-only: no-op unless LORAPLEX_FAULTS is set
    resources = CpuAssistResources(runtime) if runtime.spec.adapter_load_mode == "cpu_assist" else None
    return runtime, resources


def _serve(state: tuple[EngineRuntime, CpuAssistResources | None], sock: TypedSocket, demo: bool) -> None:
    runtime, resources = state
    server = EngineServer(runtime, sock, demo=demo, resources=resources)
    try:
        server.serve()
    finally:
        server.stores.close()
        if resources is not None:
            resources.close()


def main(argv: list[str] | None = None) -> int:
    return run_child(ROLE, "engine", argv, _start, _serve)


if __name__ == "__main__":
    raise SystemExit(main())
