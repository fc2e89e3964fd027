"""The engine spec: how the daemon configures each child process it starts (an engine, the
cache manager): the model, where it runs, how the unified pool is sized, and what is per
daemon (its shared-memory names, the directories adapter files must lie in). The daemon builds
it once from its configuration (LoraplexConfig.engine_spec); a link adds what is per child and
per start, and hands it over as JSON on the child's command line.

Neutral ground between the two sides: it imports neither the daemon nor the engine nor torch.
Each engine setting's default and checks are defined here once; the daemon's [model] section
takes both from here. `auto` values stay `auto` until the engine resolves them for its machine
(gpu_engine/runtime.py) and reports what it chose in its hello.
"""
from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, fields
from enum import Enum

from loraplex.contracts.settings import Checks, ConfigError

DEFAULT_MAX_NUM_SEQS = 64  # the largest batch: the scheduler's limit, and the engine's largest decode graph
DEVICE_PATTERN = re.compile(r"auto|cpu|cuda(:\d+)?")
DTYPES: tuple[str, ...] = ("auto", "float32", "bfloat16", "float16")
LORA_BACKENDS: tuple[str, ...] = ("auto", "torch", "triton")
LOAD_FORMATS: tuple[str, ...] = ("safetensors", "dummy")  # dummy: random weights from config.json alone


class LoadMode(str, Enum):
    """How a cold adapter reaches the GPU (README, "Adapter load modes"), named once: members equal
    their names, so settings, wire fields and stats stay plain strings."""

    AUTO = "auto"  # cpu_assist on CUDA (on_demand under tensor parallelism), else on_demand
    CACHED = "cached"
    ON_DEMAND = "on_demand"
    CPU_ASSIST = "cpu_assist"

    def __str__(self) -> str:
        return self.value


ADAPTER_LOAD_MODES: tuple[str, ...] = tuple(mode.value for mode in LoadMode)


def check_engine_settings(checks: Checks) -> None:
    """The checks of the engine settings (the EngineSpec fields a [model] section also has), on
    values already of their declared types. Raises ConfigError naming the key."""
    values = checks.values
    if values.model is not None and not values.model:
        checks.fail("model", f"{checks.key('model')} must be a non-empty path (or unset for the demo model)")
    if not DEVICE_PATTERN.fullmatch(values.device):
        checks.fail("device", f"{checks.key('device')} must be auto, cpu, cuda or cuda:N; got {values.device!r}")
    checks.choice("load_format", LOAD_FORMATS)
    checks.choice("dtype", DTYPES)
    checks.choice("lora_backend", LORA_BACKENDS)
    checks.positive("max_lora_rank")
    for name in ("max_model_len", "page_tokens", "num_pages", "pool_bytes", "cpu_threads"):
        checks.positive(name, optional=True)
    if values.num_pages is not None and values.pool_bytes is not None:
        checks.fail("pool_bytes", f"{checks.key('num_pages')} and {checks.key('pool_bytes')} both size the pool; "
                                  "set at most one")
    checks.finite("gpu_memory_utilization", low=0.0, high=1.0, low_open=True)
    checks.choice("adapter_load_mode", ADAPTER_LOAD_MODES)
    for name in ("host_store_bytes", "exchange_max_tokens"):
        checks.positive(name)
    checks.finite("load_throttle_bytes_s", low=0.0, low_open=True, optional=True)
    checks.positive("tensor_parallel_size")
    if values.tensor_parallel_size > 1:
        # The Triton backend would need its shrink and expand split around the collective; until
        # that is built, TP runs the torch backend. (cpu_assist under TP runs on CPU hosts only:
        # the engine refuses it on CUDA at start, gpu_engine/runtime.py resolve_spec.)
        if values.lora_backend == "triton":
            checks.fail("lora_backend", f"{checks.key('lora_backend')}=triton is not supported with "
                                        f"{checks.key('tensor_parallel_size')}={values.tensor_parallel_size} yet")


@dataclass(frozen=True, slots=True)
class EngineSpec:
    model: str | None = None  # a model directory (HF layout); None: the built-in demo model
    load_format: str = "safetensors"  # or dummy: random weights from config.json alone (benchmarks)
    device: str = "auto"  # auto (cuda if available, else cpu), cpu, cuda or cuda:N
    dtype: str = "auto"  # auto: bfloat16 on CUDA, float32 on CPU
    max_lora_rank: int = 256
    lora_backend: str = "auto"  # auto: triton on CUDA (torch under TP), torch on CPU
    max_model_len: int | None = None  # None: the model's limit
    page_tokens: int | None = None  # None: derived from the model
    num_pages: int | None = None  # at most one of num_pages, pool_bytes; neither: gpu_memory_utilization
    pool_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    adapter_load_mode: str = "auto"  # auto: cpu_assist on CUDA (on_demand under TP), else on_demand
    host_store_bytes: int = 256 << 20
    exchange_max_tokens: int = 2048  # most prefill tokens per step CPU workers can take (cpu_assist)
    load_throttle_bytes_s: float | None = None  # test-only: cap the host -> pool adapter copy rate
    cuda_graphs: bool = True  # capture decode steps as CUDA graphs (on CUDA with lora_backend=triton)
    cpu_threads: int | None = None  # torch threads of each engine process; None: auto (resolve_spec)
    cpu_packed_weights: bool = True  # float32 on CPU: projections through oneDNN-packed weight copies
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS  # the largest decode batch: the largest graph bucket
    adapter_dirs: tuple[str, ...] = ()  # every adapter file must resolve inside one (empty: anywhere)
    shm_instance: str | None = None  # names the daemon's shared-memory segments
    host_store_segment: str = ""  # the cache manager's store (its own, or the one an engine attaches)
    tensor_parallel_size: int = 1  # ranks (devices) one engine's model is split over (Megatron-LM + S-LoRA)
    replica: int = 0  # which of the daemon's engines this is: `cuda` means GPU (replica mod GPU count)

    def __post_init__(self) -> None:
        checks = Checks(self, "")
        checks.types()
        check_engine_settings(checks)
        checks.positive("max_num_seqs")
        if self.replica < 0:
            checks.fail("replica", f"replica must be >= 0, got {self.replica}")

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> EngineSpec:
        """The spec a daemon sent; ConfigError (a ValueError) for a field this spec does not know,
        a value of the wrong type or out of range."""
        data = json.loads(text)
        if not isinstance(data, dict):
            raise ConfigError(f"the engine spec must be a JSON object, got {type(data).__name__}")
        unknown = sorted(set(data) - {f.name for f in fields(cls)})
        if unknown:
            raise ConfigError(f"unknown engine spec fields: {', '.join(unknown)}", unknown[0])
        return cls(**data)
