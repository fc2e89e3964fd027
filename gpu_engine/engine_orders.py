"""What an engine does with each order it runs, the same on every rank of a
tensor-parallel engine: run a step plan, load an adapter into host memory (from
the cache manager's store, else its file, resolved against the same allow-list),
unload one. Replies are protocol messages; a failure an engine survives is an
`engine_failure`, and a step that fails is first run again without the rows that fail
alone (gpu_engine/row_isolation.py), which fail their own requests only. Plan
bookkeeping (the persistent batch) and the daemon socket stay with rank 0
(gpu_engine/engine_process.py); gpu_engine/tp/worker.py drives the other ranks with
the orders rank 0 shares.
"""
from __future__ import annotations

import logging
import traceback

import torch
import torch.distributed as dist

from loraplex.contracts.geometry import AdapterLayout
from loraplex.errors import LoraplexRequestError
from loraplex.gpu_engine.lora.peft_adapter import HostAdapter, load_peft_adapter
from loraplex.gpu_engine.row_isolation import isolate_step
from loraplex.gpu_engine.runtime import EngineRuntime
from loraplex.gpu_engine.store_reader import StoreReader
from loraplex.ipc.adapter_files import allow_also, resolve_roots
from loraplex.ipc.engine_plan import StepPlan
from loraplex.ipc.errors import ErrorCode
from loraplex.ipc.protocol import (
    EngineAdapterLoaded,
    EngineFailure,
    EngineLoadAdapter,
    EngineStep,
    EngineStepDone,
    EngineUnloadAdapter,
    Message,
)

log = logging.getLogger("loraplex-engine")
# torch.OutOfMemoryError since 2.5; torch.cuda.OutOfMemoryError (its alias now) before.
_OOM_ERRORS = (getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError), MemoryError)
# A collective that failed (a rank gone, a timeout): the group is broken, so the rank exits.
_GROUP_ERRORS = (dist.DistBackendError, dist.DistNetworkError)


class EngineOrders:
    def __init__(self, runtime: EngineRuntime, *, store=None, demo_adapters: list[str] | None = None) -> None:
        """store: the engine's own host store (cpu_assist without a cache manager), else None;
        demo_adapters: the built-in demo's adapter directories, always allowed."""
        self.runtime = runtime
        self.store = store
        self.stores = StoreReader(pin=runtime.executor.device.type == "cuda")  # the cache manager's store
        # where adapter files may resolve (server.adapter_dirs), plus the demo's own adapters
        self.roots = allow_also(resolve_roots(runtime.spec.adapter_dirs), demo_adapters or [])

    def close(self) -> None:
        self.stores.close()

    def run(self, msg: Message) -> Message:
        if isinstance(msg, EngineStep):
            return self.step(msg.plan)
        if isinstance(msg, EngineLoadAdapter):
            return self.load(msg)
        if isinstance(msg, EngineUnloadAdapter):
            return self.unload(msg.name)
        return EngineFailure(code=ErrorCode.UNKNOWN_TYPE.value, message=f"engine cannot handle {msg.TYPE}")

    def settle(self, msg: Message, reply: Message, failures: int, rank: int, world_size: int) -> Message:
        """After every rank ran `msg`, `failures` of them failing: where some failed and some did
        not, undo what now differs (an adapter loaded on some ranks only is dropped on all; a
        failure on every rank left every rank as it was) and answer with a failure."""
        if failures == 0 or (failures == world_size and isinstance(reply, EngineFailure)):
            return reply
        if isinstance(msg, EngineLoadAdapter):
            self.unload(msg.name)
        if isinstance(reply, EngineFailure):
            return reply
        subject = msg.name if isinstance(msg, EngineLoadAdapter) else \
            str(msg.plan.step_id) if isinstance(msg, EngineStep) else ""
        return EngineFailure(code=ErrorCode.ENGINE_FAILED.value, subject=subject,
                             message=f"{msg.TYPE} failed on {failures} of {world_size} tensor-parallel ranks, "
                                     f"not on rank {rank} (see the others' log)")

    def step(self, plan: StepPlan) -> Message:
        executor = self.runtime.executor
        try:
            try:
                return EngineStepDone(result=executor.execute(plan))
            except _GROUP_ERRORS + _OOM_ERRORS:
                raise
            except Exception as exc:
                # One device and no CPU workers mid-protocol: the rows run again in halves, and the
                # rows that fail alone fail their own requests (raises again when none can be blamed).
                if executor.split.world_size > 1 or plan.cpu is not None or len(plan.rows) < 2:
                    raise
                log.error("step %d failed; isolating its rows: %r", plan.step_id, exc)
                placed = all(p.name in executor.resident for p in plan.place)
                return EngineStepDone(result=isolate_step(executor.execute, plan, exc, placed=placed,
                                                          passthrough=_GROUP_ERRORS + _OOM_ERRORS))
        except _GROUP_ERRORS:
            raise
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

    def unload(self, name: str) -> Message:
        self.runtime.executor.remove_host_adapter(name)
        self.stores.forget(name)
        if self.store is not None:
            self.store.remove(name)
        return EngineAdapterLoaded(name=name, rank=0, target_modules=[], num_pages=0, nbytes=0)

    def load(self, msg: EngineLoadAdapter) -> Message:
        executor = self.runtime.executor
        spec, cfg = self.runtime.spec, self.runtime.config
        try:
            if msg.store_entry is not None:  # weights already in the cache manager's store: view them
                adapter = self.stores.adapter(msg.name, msg.path, msg.store_segment, msg.store_entry, cfg,
                                              max_lora_rank=spec.max_lora_rank, roots=self.roots)
            else:
                adapter = load_peft_adapter(msg.name, msg.path, cfg, max_lora_rank=spec.max_lora_rank,
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
        if self.store is not None:
            try:
                entry = self.store.put(adapter, cfg.adapter_shapes(), cfg.num_layers)
            except RuntimeError as exc:
                return EngineFailure(code=ErrorCode.OVERLOADED.value, message=str(exc), subject=msg.name)
        try:
            layout = executor.add_host_adapter(adapter)
        except ValueError as exc:  # a target the engine's ranks do not split (lm_head, embed_tokens)
            if entry is not None:
                self.store.remove(msg.name)
            return EngineFailure(code=ErrorCode.INVALID_ADAPTER.value, message=f"adapter {msg.name}: {exc}",
                                 subject=msg.name)
        return EngineAdapterLoaded(name=msg.name, rank=adapter.spec.rank, target_modules=list(adapter.spec.targets),
                                   num_pages=layout.num_pages, nbytes=adapter.nbytes, store_entry=entry,
                                   scaling=adapter.spec.scaling)

    def _replace_host(self, adapter: HostAdapter) -> AdapterLayout:
        self.runtime.executor.remove_host_adapter(adapter.name)  # a reload replaces the old weights
        return self.runtime.executor.add_host_adapter(adapter)
