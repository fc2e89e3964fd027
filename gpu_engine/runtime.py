"""Build an executor from user-level settings: resolve the model directory,
device, dtype and pool size, load the weights, and lay out the unified pool.

Shared by the offline `LLM` and the engine process so both interpret the
same knobs the same way.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch

from loraplex.contracts.geometry import PageGeometry
from loraplex.gpu_engine.executor import Executor
from loraplex.gpu_engine.lora.backend import LORA_BACKENDS
from loraplex.gpu_engine.model.config import ModelConfig
from loraplex.gpu_engine.model.weights import LOAD_FORMATS, load_weights, random_weights
from loraplex.gpu_engine.pool import UnifiedPool
from loraplex.ipc.adapter_files import resolve_roots

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEFAULT_CPU_POOL_BYTES = 512 << 20
DEFAULT_GRAPH_BATCH = 64  # largest captured decode batch when the caller does not say (LLM's max_num_seqs)


@dataclass(frozen=True, slots=True)
class EngineSpec:
    model: str | None = None  # None = the built-in demo model
    load_format: str = "safetensors"  # or dummy: random weights from config.json alone (benchmarks)
    device: str = "cpu"  # cpu, cuda, cuda:N or auto
    dtype: str = "float32"  # or auto: bfloat16 on CUDA, float32 on CPU
    max_lora_rank: int = 256
    lora_backend: str = "torch"  # or auto: triton on CUDA, torch on CPU
    num_pages: int | None = None
    pool_bytes: int | None = None
    page_tokens: int | None = None
    max_model_len: int | None = None
    gpu_memory_utilization: float = 0.9
    # Test-only: cap the host->pool adapter copy rate on CPU so loads span many layers.
    load_throttle_bytes_s: float | None = None
    adapter_load_mode: str = "on_demand"  # or cached, cpu_assist, auto (cpu_assist on CUDA)
    load_groups: int = 1
    host_store_bytes: int = 256 << 20
    exchange_max_tokens: int = 2048
    shm_instance: str | None = None  # names the shared-memory segments (set by the daemon)
    host_store_segment: str = ""  # set by the daemon: the cache manager's store; the engine only attaches it
    replica: int = 0  # which of the daemon's engines this is: `cuda` means GPU (replica mod GPU count)
    cuda_graphs: bool = True  # capture decode steps as CUDA graphs (effective on CUDA with lora_backend=triton)
    max_num_seqs: int = DEFAULT_GRAPH_BATCH  # the largest decode batch: the largest graph bucket
    adapter_dirs: tuple[str, ...] = ()  # server.adapter_dirs: every adapter file must resolve inside (empty: anywhere)

    @property
    def adapter_roots(self) -> tuple[str, ...]:
        """adapter_dirs resolved (symlinks, `~`), as adapter files are checked against them."""
        return resolve_roots(self.adapter_dirs)

    def resolved(self) -> EngineSpec:
        """Replace the `auto` values by what this machine supports; validate the rest."""
        cuda = torch.cuda.is_available()
        device = ("cuda" if cuda else "cpu") if self.device == "auto" else self.device
        if device == "cuda" and cuda:  # one engine per GPU; more engines than GPUs share them round-robin
            device = f"cuda:{self.replica % torch.cuda.device_count()}"
        if device.startswith("cuda") and not cuda:
            raise ValueError(f"device={device!r} requested but CUDA is not available")
        if device != "cpu" and not device.startswith("cuda"):
            raise ValueError(f"device must be cpu, cuda, cuda:N or auto, got {device!r}")
        dtype = ("bfloat16" if device.startswith("cuda") else "float32") if self.dtype == "auto" else self.dtype
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)} or auto, got {self.dtype!r}")
        backend = ("triton" if device.startswith("cuda") else "torch") if self.lora_backend == "auto" \
            else self.lora_backend
        if backend not in LORA_BACKENDS:
            raise ValueError(f"lora_backend must be one of {LORA_BACKENDS} or auto, got {self.lora_backend!r}")
        if not isinstance(self.max_lora_rank, int) or self.max_lora_rank <= 0:
            raise ValueError(f"max_lora_rank must be a positive integer, got {self.max_lora_rank!r}")
        if not isinstance(self.max_num_seqs, int) or self.max_num_seqs <= 0:
            raise ValueError(f"max_num_seqs must be a positive integer, got {self.max_num_seqs!r}")
        model = self.model
        if model is None:
            from loraplex.gpu_engine.demo import builtin_demo

            model = str(builtin_demo().model_dir)
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {self.load_format!r}")
        mode = self.adapter_load_mode
        if mode == "auto":
            mode = "cpu_assist" if device.startswith("cuda") else "on_demand"
        if mode not in ("cached", "on_demand", "cpu_assist"):
            raise ValueError(f"adapter_load_mode must be auto, cached, on_demand or cpu_assist, got {mode!r}")
        return dataclasses.replace(self, model=model, device=device, dtype=dtype, lora_backend=backend,
                                   adapter_load_mode=mode, adapter_dirs=tuple(self.adapter_dirs))


@dataclass(slots=True)
class EngineRuntime:
    spec: EngineSpec  # resolved
    config: ModelConfig
    geometry: PageGeometry
    executor: Executor
    num_pages: int
    max_model_len: int

    @property
    def model_dir(self) -> Path:
        return Path(self.spec.model or "")


def build_runtime(spec: EngineSpec, *, max_num_seqs: int | None = None) -> EngineRuntime:
    """The engine's model, pool and executor for `spec`; decode graphs are captured for batches up to
    `max_num_seqs` (default spec.max_num_seqs)."""
    spec = spec.resolved()
    model_dir = Path(spec.model or "")
    device, dtype = torch.device(spec.device), DTYPES[spec.dtype]
    config = ModelConfig.from_dir(model_dir)
    weights = random_weights(config, device=device, dtype=dtype) if spec.load_format == "dummy" \
        else load_weights(model_dir, config, device=device, dtype=dtype)
    geometry = PageGeometry.for_model(config.module_shapes(), config.kv_dim, spec.page_tokens)
    num_pages = spec.num_pages
    if num_pages is None:
        pool_bytes = spec.pool_bytes
        if pool_bytes is None:
            if device.type == "cuda":
                free, _ = torch.cuda.mem_get_info(device)
                pool_bytes = int(free * spec.gpu_memory_utilization)
            else:
                pool_bytes = DEFAULT_CPU_POOL_BYTES
        # less the executor's scratch page, so the pool stays within the byte budget
        num_pages = max(1, UnifiedPool.pages_for_bytes(config.num_layers, geometry, dtype, pool_bytes) - 1)
    executor = Executor(config, weights, geometry, num_pages, device=device, dtype=dtype,
                        lora_backend=spec.lora_backend, load_throttle_bytes_s=spec.load_throttle_bytes_s)
    limit = min(config.max_position_embeddings, num_pages * geometry.page_tokens)
    max_model_len = min(spec.max_model_len, limit) if spec.max_model_len else limit
    executor.setup_decode_graphs(max_batch=max_num_seqs or spec.max_num_seqs, max_model_len=max_model_len,
                                 max_lora_rank=spec.max_lora_rank, enabled=spec.cuda_graphs)
    return EngineRuntime(spec=spec, config=config, geometry=geometry, executor=executor, num_pages=num_pages,
                         max_model_len=max_model_len)
