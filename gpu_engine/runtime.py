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
from loraplex.contracts.engine_spec import EngineSpec
from loraplex.gpu_engine.executor import Executor
from loraplex.gpu_engine.model.config import ModelConfig
from loraplex.gpu_engine.model.weights import load_weights, random_weights
from loraplex.gpu_engine.pool import UnifiedPool

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEFAULT_CPU_POOL_BYTES = 512 << 20


def resolve_spec(spec: EngineSpec) -> EngineSpec:
    """The spec with its `auto` values replaced by what this machine supports, and the built-in demo
    model when none is set: the one place they are resolved. The engine reports the result in its
    hello; the cache manager resolves the same spec the same way, so both agree on the dtype."""
    cuda = torch.cuda.is_available()
    device = ("cuda" if cuda else "cpu") if spec.device == "auto" else spec.device
    if device == "cuda" and cuda:  # one engine per GPU; more engines than GPUs share them round-robin
        device = f"cuda:{spec.replica % torch.cuda.device_count()}"
    if device.startswith("cuda") and not cuda:
        raise ValueError(f"device={device!r} requested but CUDA is not available")
    on_gpu = device.startswith("cuda")
    dtype = ("bfloat16" if on_gpu else "float32") if spec.dtype == "auto" else spec.dtype
    backend = ("triton" if on_gpu else "torch") if spec.lora_backend == "auto" else spec.lora_backend
    mode = ("cpu_assist" if on_gpu else "on_demand") if spec.adapter_load_mode == "auto" else spec.adapter_load_mode
    model = spec.model
    if model is None:
        from loraplex.gpu_engine.demo import builtin_demo

        model = str(builtin_demo().model_dir)
    return dataclasses.replace(spec, model=model, device=device, dtype=dtype, lora_backend=backend,
                               adapter_load_mode=mode)


@dataclass(slots=True)
class EngineRuntime:
    spec: EngineSpec  # resolved (resolve_spec)
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
    spec = resolve_spec(spec)
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
    executor.sampler.tokenizer_json = model_dir / "tokenizer.json"  # structured output compiles against it
    limit = min(config.max_position_embeddings, num_pages * geometry.page_tokens)
    max_model_len = min(spec.max_model_len, limit) if spec.max_model_len else limit
    executor.setup_decode_graphs(max_batch=max_num_seqs or spec.max_num_seqs, max_model_len=max_model_len,
                                 max_lora_rank=spec.max_lora_rank, enabled=spec.cuda_graphs)
    return EngineRuntime(spec=spec, config=config, geometry=geometry, executor=executor, num_pages=num_pages,
                         max_model_len=max_model_len)
