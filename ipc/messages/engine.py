"""Messages between the daemon and an engine process (private socket in the runtime dir).

Owns the declarations only: hello (the engine's dimensions, sent once ready),
adapter load/unload into the engine's host store, step plans and their
results, shutdown, and engine-side failures. Tensors never travel here; plans
carry token ids and page indices only.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from loraplex.ipc.adapter_store import StoreEntry
from loraplex.ipc.engine_plan import StepPlan, StepResult
from loraplex.ipc.exchange import ExchangeLayout
from loraplex.ipc.messages.base import Message, register
from loraplex.ipc.messages.checks import Name
from loraplex.ipc.plan_delta import StepDelta


@register
@dataclass(frozen=True, slots=True)
class EngineHello(Message):
    """First message of a started engine: what it runs and how its pool is laid out."""

    TYPE = "engine_hello"
    pid: int
    model_dir: str
    device: str
    dtype: str
    vocab_size: int
    num_layers: int
    hidden_size: int
    kv_dim: int
    max_model_len: int
    num_pages: int
    page_tokens: int
    page_elems: int
    eos_token_ids: list[int] = field(default_factory=list)
    bos_token_id: int | None = None
    lora_backend: str = "torch"
    demo_adapters: dict[str, str] = field(default_factory=dict)  # name -> dir, when serving the demo model
    load_mode: str = "on_demand"
    link_bytes_per_s: float = 0.0  # measured host->pool copy bandwidth
    store_segment: str = ""  # the host adapter store (cpu_assist)
    exchange: ExchangeLayout | None = None  # the activation exchange (cpu_assist)
    cuda_graphs: bool = False  # decode steps replay captured CUDA graphs
    graph_buckets: list[int] = field(default_factory=list)  # their batch sizes
    graph_reason: str = ""  # why decode steps run eagerly ("" when graphs are on)
    tensor_parallel_size: int = 1  # rank processes the model is split over (rank 0 sent this hello)
    cpu_threads: int = 0  # torch threads of each engine process (model.cpu_threads, resolved)
    rank_pids: list[int] = field(default_factory=list)  # the other ranks' processes (rank 1, 2, ...)
    # The sliding window (tokens) every attention layer shares; None where some layer sees its whole
    # context. The daemon gives pages wholly out of it back to the pool (SchedulerConfig.kv_window).
    kv_window: int | None = None


@register
@dataclass(frozen=True, slots=True)
class EngineLoadAdapter(Message):
    """Read and validate a PEFT directory into the engine's host memory, or (store_entry
    set) take its weights from the cache manager's host store `store_segment` without
    copying; keep_resident: same content as the copy already held, keep its GPU pages."""

    TYPE = "engine_load_adapter"
    name: Name
    path: str
    store_segment: str = ""
    store_entry: StoreEntry | None = None
    keep_resident: bool = False


@register
@dataclass(frozen=True, slots=True)
class EngineAdapterLoaded(Message):
    TYPE = "engine_adapter_loaded"
    name: str
    rank: int
    target_modules: list[str]
    num_pages: int
    nbytes: int
    store_entry: StoreEntry | None = None  # where it sits in the host store (cpu_assist)
    scaling: float = 1.0  # s in y = xW + s·(xA)B


@register
@dataclass(frozen=True, slots=True)
class EngineUnloadAdapter(Message):
    TYPE = "engine_unload_adapter"
    name: str


@register
@dataclass(frozen=True, slots=True)
class EngineStep(Message):
    TYPE = "engine_step"
    plan: StepPlan


@register
@dataclass(frozen=True, slots=True)
class EngineStepDelta(Message):
    """A step as the change against the engine's persistent batch (ipc/plan_delta.py); answered
    like EngineStep."""

    TYPE = "engine_step_delta"
    delta: StepDelta


@register
@dataclass(frozen=True, slots=True)
class EngineStepDone(Message):
    TYPE = "engine_step_done"
    result: StepResult


@register
@dataclass(frozen=True, slots=True)
class EngineShutdown(Message):
    TYPE = "engine_shutdown"


@register
@dataclass(frozen=True, slots=True)
class EngineFailure(Message):
    """An order the engine could not carry out; `code` is an ErrorCode value.
    `fatal` means the engine is exiting and must be restarted."""

    TYPE = "engine_failure"
    code: str
    message: str
    subject: str | None = None  # adapter name or step id the failure is about
    fatal: bool = False
