"""Build an executor from user-level settings: resolve the model directory,
device, dtype and pool size, load the weights, and lay out the unified pool.

Shared by the offline `LLM` and the engine process so both interpret the
same knobs the same way.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from loraplex.contracts.engine_spec import EngineSpec, LoadMode
from loraplex.contracts.geometry import PageGeometry
from loraplex.contracts.host import usable_cores
from loraplex.contracts.settings import ConfigError
from loraplex.gpu_engine.executor import Executor
from loraplex.gpu_engine.model.config import ModelConfig
from loraplex.gpu_engine.model.weights import load_weights, random_weights
from loraplex.gpu_engine.model_split import ModelSplit, WholeModel, weights_device
from loraplex.gpu_engine.pool import UnifiedPool

if TYPE_CHECKING:
    from loraplex.gpu_engine.tp.group import RankLink

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEFAULT_CPU_POOL_BYTES = 512 << 20


def auto_cpu_threads(cores: int, ranks: int) -> int:
    """Torch threads of one engine process by default: its share of `cores` (ranks of one engine
    share the host), less one core left to the daemon's process and to neighbours. Why: torch's
    parallel regions wait for their slowest thread, so one thread on a core that another process
    takes stalls every op of the step (2-7x slower steps on a 2-core host beside one busy process,
    bench/RESULTS.md "Engine threads beside a busy core"); fewer threads than cores let the OS run
    them all on the cores that are free."""
    share = max(1, cores // max(1, ranks))
    return max(1, share - 1)


def resolve_spec(spec: EngineSpec, rank: int = 0) -> EngineSpec:
    """The spec with its `auto` values replaced by what this machine supports, and the built-in demo
    model when none is set: the one place they are resolved. The engine reports the result in its
    hello; the cache manager resolves the same spec the same way, so both agree on the dtype.
    rank: which tensor-parallel rank of the engine resolves it (each has its own GPU)."""
    cuda = torch.cuda.is_available()
    device = ("cuda" if cuda else "cpu") if spec.device == "auto" else spec.device
    ranks = spec.tensor_parallel_size
    if device == "cuda" and cuda:  # one GPU per rank; more engines than GPUs share them round-robin
        device = f"cuda:{(spec.replica * ranks + rank) % torch.cuda.device_count()}"
    elif device.startswith("cuda:") and rank:  # cuda:K: the engine's ranks on GPUs K, K+1, ...
        device = f"cuda:{(int(device[5:]) + rank) % max(1, torch.cuda.device_count())}"
    if device.startswith("cuda") and not cuda:
        raise ValueError(f"device={device!r} requested but CUDA is not available")
    on_gpu = device.startswith("cuda")
    dtype = ("bfloat16" if on_gpu else "float32") if spec.dtype == "auto" else spec.dtype
    tp = ranks > 1  # TP runs the torch backend and GPU-only loading (EngineSpec's checks)
    backend = ("triton" if on_gpu and not tp else "torch") if spec.lora_backend == "auto" else spec.lora_backend
    mode = spec.adapter_load_mode
    if mode == LoadMode.AUTO:
        mode = (LoadMode.CPU_ASSIST if on_gpu and not tp else LoadMode.ON_DEMAND).value
    if tp and on_gpu and mode == LoadMode.CPU_ASSIST:  # its sync-free CUDA path (cpu_assist_cuda.py) is one device's
        raise ConfigError("adapter_load_mode=cpu_assist with tensor_parallel_size > 1 runs on CPU hosts only "
                          "for now (on CUDA use on_demand or cached, or tensor_parallel_size 1)", "adapter_load_mode")
    model = spec.model
    if model is None:
        from loraplex.gpu_engine.demo import builtin_demo

        model = str(builtin_demo().model_dir)
    threads = spec.cpu_threads or auto_cpu_threads(usable_cores(), ranks)
    return dataclasses.replace(spec, model=model, device=device, dtype=dtype, lora_backend=backend,
                               adapter_load_mode=mode, cpu_threads=threads)


def model_split(config: ModelConfig, comm=None, *, assisted: bool = False) -> ModelSplit:
    """One device, or this rank's part of a tensor-parallel engine (ValueError: cannot split N ways).
    assisted: adapter_load_mode is cpu_assist (every rank joins rank 0's CPU-assisted sites)."""
    if comm is None or comm.world_size == 1:
        return WholeModel(config)
    from loraplex.gpu_engine.tp.shard import TpShard

    return TpShard(config, comm, assisted=assisted)


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


def build_runtime(spec: EngineSpec, *, max_num_seqs: int | None = None, link: RankLink | None = None) -> EngineRuntime:
    """The engine's model, pool and executor for `spec`; decode graphs are captured for batches up to
    `max_num_seqs` (default spec.max_num_seqs). link: this rank's membership when the engine is split
    over spec.tensor_parallel_size ranks (gpu_engine/tp/group.py); the executor then holds its shard."""
    comm = link.comm if link is not None else None
    spec = resolve_spec(spec, comm.rank if comm is not None else 0)
    torch.set_num_threads(spec.cpu_threads)  # process-wide: the offline LLM passes the caller's own count
    model_dir = Path(spec.model or "")
    device, dtype = torch.device(spec.device), DTYPES[spec.dtype]
    config = ModelConfig.from_dir(model_dir)
    split = model_split(config, comm, assisted=spec.adapter_load_mode == LoadMode.CPU_ASSIST)
    if spec.load_format == "dummy":
        # Every rank makes the whole model from the same seed and keeps its slice, so the ranks'
        # random values agree (host memory: the whole model, once per rank; benchmarks only).
        weights = split.shard_weights(random_weights(config, device=weights_device(split, device), dtype=dtype))
    else:  # a rank reads only its slice of each tensor, moved to the device tensor by tensor
        weights = load_weights(model_dir, config, device=device, dtype=dtype, select=split.weight_selector())
    weights = weights.to(device)
    geometry = split.plan.geometry(spec.page_tokens)
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
        if link is not None:  # a page index means the same on every rank: as many as the smallest holds
            num_pages = link.control.min_int(num_pages)
    executor = Executor(config, weights, geometry, num_pages, device=device, dtype=dtype,
                        lora_backend=spec.lora_backend, load_throttle_bytes_s=spec.load_throttle_bytes_s,
                        split=split, packed_weights=spec.cpu_packed_weights)
    executor.sampler.tokenizer_json = model_dir / "tokenizer.json"  # structured output compiles against it
    limit = min(config.max_position_embeddings, num_pages * geometry.page_tokens)
    max_model_len = min(spec.max_model_len, limit) if spec.max_model_len else limit
    executor.setup_decode_graphs(max_batch=max_num_seqs or spec.max_num_seqs, max_model_len=max_model_len,
                                 max_lora_rank=spec.max_lora_rank, enabled=spec.cuda_graphs)
    return EngineRuntime(spec=spec, config=config, geometry=geometry, executor=executor, num_pages=num_pages,
                         max_model_len=max_model_len)
