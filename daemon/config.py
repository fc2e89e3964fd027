"""The daemon's configuration: the frozen dataclasses that declare every setting.

Owns the settings (model, scheduler, server, adapters) and their validation; the one
loader that maps defaults < TOML file < LORAPLEX_* environment < command-line flags onto
them is daemon/config_load.py, the TOML writer daemon/config_toml.py, the names settings go
by outside these classes (environment, default directories) daemon/config_names.py; the engine spec
every child process starts with is built from them once (LoraplexConfig.engine_spec). The
[model] section's engine settings take their defaults and checks from
loraplex/contracts/engine_spec.py, the scheduling limits theirs from
daemon/scheduler/config.py. Must never import torch or numpy, and never touch the
filesystem: resolving devices, paths and pools happens where they are used (`auto` values
in the engine, gpu_engine/runtime.py).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import ClassVar

from loraplex.contracts.engine_spec import EngineSpec, LoadMode, check_engine_settings
from loraplex.contracts.names import is_valid_name as is_valid_adapter_name
from loraplex.contracts.settings import Checks, ConfigError
from loraplex.daemon.config_names import TCP_ENDPOINT, default_state_dir, is_loopback_endpoint
from loraplex.daemon.gpu_cache.predictor import PredictorConfig
from loraplex.daemon.router import ROUTERS
from loraplex.daemon.scheduler.config import DEFAULT_OVERLAP, SchedulerConfig

# Scheduling policies the daemon can build; extend when a policy lands in daemon/scheduler.
SCHEDULER_POLICIES: tuple[str, ...] = ("fcfs", "mlq", "dlora")
CACHE_POLICIES: tuple[str, ...] = ("none", "lru", "fifo", "cost")
# Same value as loraplex.ipc.codec.DEFAULT_MAX_MESSAGE_BYTES (not imported: that pulls in zmq).
DEFAULT_MAX_MESSAGE_BYTES = 8 << 20
# Each default is defined once: the engine settings' in EngineSpec, the scheduling limits' in
# SchedulerConfig, the predictor's in PredictorConfig; the sections below take theirs from these.
_ENGINE = EngineSpec()
_ENGINE_FIELDS = frozenset(f.name for f in fields(EngineSpec))
_SCHEDULER = SchedulerConfig()
_PREDICTOR = PredictorConfig()
# Fields holding filesystem paths: `~` is expanded and relative paths are anchored
# (at the TOML file's directory for file values, at the working directory otherwise).
PATH_KEYS = frozenset({"server.runtime_dir", "server.state_dir", "server.adapter_dirs", "scheduler.router_profile",
                        "server.tcp_curve_secret_key_file", "server.tcp_curve_allowed_keys"})


def _help(text: str, example: str | None = None) -> dict[str, str]:
    """Field metadata: the comment example_toml() writes, and a sample value for unset options."""
    return {"help": text} if example is None else {"help": text, "example": example}


@dataclass(frozen=True, slots=True)
class ModelSettings:
    """The base model, where it runs, and how the unified GPU pool is sized."""

    SECTION: ClassVar[str] = "model"

    model: str | None = field(default=_ENGINE.model, metadata=_help(
        "Base model directory (HF layout); unset = the built-in demo model.", "/srv/models/llama"))
    load_format: str = field(default=_ENGINE.load_format, metadata=_help(
        "safetensors (the checkpoint), or dummy: random weights from config.json alone, for benchmarks at "
        "real model sizes with nothing to download (outputs are meaningless)."))
    device: str = field(default=_ENGINE.device, metadata=_help(
        "auto (cuda if available, else cpu), cpu, cuda or cuda:N."))
    dtype: str = field(default=_ENGINE.dtype, metadata=_help(
        "Weight and activation dtype: auto, float32, bfloat16, float16."))
    max_lora_rank: int = field(default=_ENGINE.max_lora_rank, metadata=_help(
        "Largest adapter rank accepted; larger ones are refused."))
    lora_backend: str = field(default=_ENGINE.lora_backend, metadata=_help(
        "LoRA kernels: auto, torch (reference) or triton."))
    max_model_len: int | None = field(default=_ENGINE.max_model_len, metadata=_help(
        "Longest sequence (prompt + output) in tokens; unset = the model's limit.", "4096"))
    page_tokens: int | None = field(default=_ENGINE.page_tokens, metadata=_help(
        "Tokens per KV page of the unified pool; unset = derived from the model.", "16"))
    num_pages: int | None = field(default=_ENGINE.num_pages, metadata=_help(
        "Pool size in pages (set at most one of num_pages, pool_bytes).", "4096"))
    pool_bytes: int | None = field(default=_ENGINE.pool_bytes, metadata=_help(
        "Pool size in bytes; with num_pages also unset, sized from gpu_memory_utilization.", "8589934592"))
    gpu_memory_utilization: float = field(default=_ENGINE.gpu_memory_utilization, metadata=_help(
        "Fraction of device memory for weights + pool, in (0, 1]."))
    adapter_load_mode: str = field(default=_ENGINE.adapter_load_mode, metadata=_help(
        "How cold adapters reach the GPU: cached (all preloaded), on_demand (copied when needed; see "
        "scheduler.admit_when_loaded), "
        "cpu_assist (CPU workers compute while layer groups load), auto (cpu_assist on CUDA, else on_demand)."))
    load_groups: int = field(default=4, metadata=_help("Layer groups a cold adapter is loaded in (cpu_assist)."))
    host_store_bytes: int = field(default=_ENGINE.host_store_bytes, metadata=_help(
        "Size of the cache manager's shared-memory host adapter store; adapters beyond it stay on disk "
        "and are loaded when a request needs them (disk -> host -> GPU tiers)."))
    exchange_max_tokens: int = field(default=_ENGINE.exchange_max_tokens, metadata=_help(
        "Most prefill tokens per step that CPU workers can take (cpu_assist)."))
    load_throttle_bytes_s: float | None = field(default=_ENGINE.load_throttle_bytes_s, metadata=_help(
        "Test-only: cap the adapter copy rate on CPU hosts so loads span many layers (one link that "
        "concurrent loads share, as on a GPU's copy stream).", "4e6"))
    tensor_parallel_size: int = field(default=_ENGINE.tensor_parallel_size, metadata=_help(
        "Split the model over this many rank processes (devices) per engine: Megatron-LM for the base "
        "weights, S-LoRA for the adapters; gloo on CPU, NCCL on CUDA. Above 1: the torch LoRA backend, "
        "and adapter_load_mode on_demand or cached (auto picks on_demand)."))
    cuda_graphs: bool = field(default=_ENGINE.cuda_graphs, metadata=_help(
        "Replay decode steps of up to scheduler.max_num_seqs rows as captured CUDA graphs (on CUDA with the "
        "triton LoRA backend; elsewhere decode runs eagerly)."))

    cpu_threads: int | None = field(default=_ENGINE.cpu_threads, metadata=_help(
        "Torch threads of each engine process (each rank under tensor parallelism); unset = auto: the "
        "process's share of the cores it may run on, less one left to the daemon and its neighbours "
        "(at least 1). Threads are not pinned, so the OS moves them off a core another process takes.",
        "4"))
    cpu_packed_weights: bool = field(default=_ENGINE.cpu_packed_weights, metadata=_help(
        "On a CPU engine in float32, run the base model's projections through a copy of their weights "
        "packed in oneDNN's blocked layout (measured 1.15x prefill and 1.2x generation on a 2-core AVX2 host; "
        "the MLP's projections gain most); costs a second copy of those weights in host memory. Off: F.linear "
        "on the checkpoint's weights."))

    def __post_init__(self) -> None:
        checks = Checks(self, "model.")
        checks.types()
        check_engine_settings(checks)
        checks.positive("load_groups")

    @property
    def uses_demo_model(self) -> bool:
        """True when no model is configured and the built-in demo serves."""
        return self.model is None


@dataclass(frozen=True, slots=True)
class SchedulerSettings:
    """Iteration-level batching limits and the policy choosing each batch."""

    SECTION: ClassVar[str] = "scheduler"

    policy: str = field(default="fcfs", metadata=_help(f"Scheduling policy: {', '.join(SCHEDULER_POLICIES)}."))
    max_num_seqs: int = field(default=_SCHEDULER.max_num_seqs, metadata=_help(
        "Most sequences in one iteration's batch."))
    max_batched_tokens: int = field(default=_SCHEDULER.max_batched_tokens, metadata=_help(
        "Token budget of one iteration (prefill + decode)."))
    max_loras_per_batch: int = field(default=_SCHEDULER.max_loras_per_batch, metadata=_help(
        "Most distinct adapters in one iteration's batch."))
    ttft_slo_ms: float | None = field(default=None, metadata=_help(
        "Early abort (S-LoRA 4.3): refuse queued requests predicted to miss this time to first token.", "2000"))
    cluster_adapters: bool = field(default=_SCHEDULER.cluster_adapters, metadata=_help(
        "Prefer admitting requests whose adapter is already running (S-LoRA adapter clustering)."))
    cache_policy: str = field(default=_SCHEDULER.cache_policy, metadata=_help(
        "GPU adapter cache eviction: none (free on last use), lru, fifo or cost (Chameleon score)."))
    cache_predictor: bool = field(default=False, metadata=_help(
        "Also prefetch into free GPU pages the adapters a histogram of their past arrival gaps expects "
        "within cache_predictor_horizon_s (only those already in the host store)."))
    cache_predictor_horizon_s: float = field(default=_PREDICTOR.horizon_s, metadata=_help(
        "cache_predictor: how far ahead an expected arrival counts."))
    prefix_cache: bool = field(default=_SCHEDULER.prefix_cache, metadata=_help(
        "Automatic prefix caching: full KV pages stay cached in idle pool pages and a later prompt "
        "with the same prefix and adapter reuses them instead of computing them again."))
    admit_when_loaded: bool = field(default=_SCHEDULER.admit_when_loaded, metadata=_help(
        "on_demand loads: a request whose adapter is still being copied to the GPU waits in the queue "
        "while the batch runs on, instead of stalling every request in the step on the copy."))
    overlap: bool = field(default=DEFAULT_OVERLAP, metadata=_help(
        "Plan each step while the engine runs the one before (one step in flight ahead; the engine "
        "feeds each decode row the token it sampled); false: the synchronous loop, which waits for "
        "each step's result before planning the next."))
    router: str = field(default="most_idle", metadata=_help(
        f"Which engine a new request goes to (with server.engines > 1): {', '.join(ROUTERS)}."))
    router_profile: str | None = field(default=None, metadata=_help(
        "rank_aware: JSON file of the fitted PERF_BGMV/PERF_MBGMV decode-step models (router PerfProfile); "
        "unset = built-in defaults.", "/var/lib/loraplex/perf_profile.json"))
    router_kernel: str = field(default="mbgmv", metadata=_help(
        "rank_aware: the decode LoRA kernel whose cost model predicts step time: bgmv or mbgmv."))
    tpt_slo_ms: float = field(default=36.0, metadata=_help(
        "rank_aware: time-per-output-token SLO an engine's predicted decode step must meet."))
    rebalance_interval_s: float = field(default=0.2, metadata=_help(
        "dlora router: seconds between checks for request-adapter co-migration across engines."))

    def __post_init__(self) -> None:
        checks = Checks(self, "scheduler.")
        checks.types()
        checks.finite("ttft_slo_ms", low=0.0, low_open=True, optional=True)
        checks.choice("policy", SCHEDULER_POLICIES)
        checks.choice("cache_policy", CACHE_POLICIES)
        checks.choice("router", tuple(ROUTERS))
        checks.choice("router_kernel", ("bgmv", "mbgmv"))
        checks.finite("tpt_slo_ms", low=0.0, low_open=True)
        checks.finite("rebalance_interval_s", low=0.0, low_open=True)
        checks.finite("cache_predictor_horizon_s", low=0.0, low_open=True)
        checks.path("router_profile", "a path or unset")
        for name in ("max_num_seqs", "max_batched_tokens", "max_loras_per_batch"):
            checks.positive(name)
        if self.max_batched_tokens < self.max_num_seqs:
            # Every running sequence needs at least one token of budget per iteration.
            raise ConfigError(
                f"scheduler.max_batched_tokens ({self.max_batched_tokens}) must be >= "
                f"scheduler.max_num_seqs ({self.max_num_seqs})",
                "scheduler.max_batched_tokens",
            )


@dataclass(frozen=True, slots=True)
class ServerSettings:
    """Where the daemon listens and keeps state, its timeouts and its limits."""

    SECTION: ClassVar[str] = "server"

    runtime_dir: str | None = field(default=None, metadata=_help(
        "Directory of the daemon's sockets; unset = $XDG_RUNTIME_DIR/loraplex or /tmp/loraplex-UID.",
        "/run/user/1000/loraplex"))
    state_dir: str | None = field(default=None, metadata=_help(
        "Directory of the adapter registry; unset = $XDG_STATE_HOME/loraplex or ~/.local/state/loraplex.",
        "/var/lib/loraplex"))
    tcp_listen: str | None = field(default=None, metadata=_help(
        "Also serve clients on this TCP endpoint; without tcp_curve_* it is unencrypted and open to anyone "
        "reaching it, so only a loopback address is accepted unless tcp_insecure is set.",
        "tcp://127.0.0.1:5555"))
    tcp_curve_secret_key_file: str | None = field(default=None, metadata=_help(
        "CURVE on tcp_listen: the server's secret key file (z85, mode 0600, from `loraplex keys generate DIR`); "
        "set together with tcp_curve_allowed_keys.", "/etc/loraplex/curve/server.key"))
    tcp_curve_allowed_keys: str | None = field(default=None, metadata=_help(
        "CURVE on tcp_listen: the client public keys admitted, a file (one z85 key per line) or a directory "
        "of *.pub files; read at start.", "/etc/loraplex/curve/clients"))
    drain_timeout_s: float = field(default=30.0, metadata=_help("Seconds a drain waits for running requests."))
    engine_start_timeout_s: float = field(default=300.0, metadata=_help("Seconds an engine may take to start."))
    engine_step_timeout_s: float = field(default=60.0, metadata=_help(
        "Seconds without a step reply before the engine counts as hung."))
    heartbeat_timeout_s: float = field(default=3.0, metadata=_help(
        "Seconds without a heartbeat (sent every 0.5 s) before a child process (engine, CPU worker) counts as "
        "hung and is killed and restarted, busy or idle."))
    spare_children: bool = field(default=True, metadata=_help(
        "Keep one warm spare process (torch imported, no device touched) per engine and for the cache manager, "
        "so a restart skips the imports (~1.5 s); costs one idle process (a few hundred MB of host RAM) each."))
    max_message_bytes: int = field(default=DEFAULT_MAX_MESSAGE_BYTES, metadata=_help("Largest message accepted."))
    max_clients_inflight: int = field(default=4096, metadata=_help("Most requests in flight over all clients."))
    stats_interval_s: float = field(default=0.25, metadata=_help("Seconds between stats snapshots on the PUB socket."))
    adapter_dirs: tuple[str, ...] = field(default=_ENGINE.adapter_dirs, metadata=_help(
        "Adapter paths must lie under one of these directories; empty = anywhere."))
    cpu_workers: int | None = field(default=None, metadata=_help(
        "CPU LoRA worker processes (cpu_assist); unset = the spare cores, at least 2.", "4"))
    max_requests_per_client: int = field(default=1024, metadata=_help(
        "Most requests one client connection may have in flight; more get a fast `overloaded` reply."))
    engines: int = field(default=1, metadata=_help(
        "Engine processes (replicas of the base model), normally one per GPU; several may share a device."))
    decision_log: str | None = field(default=None, metadata=_help(
        "Append one JSON line per scheduled step (engine, step, requests admitted, rows) to this file; "
        "`loraplex sim --decision-log` writes the same lines for a simulated trace. Unset = off.",
        "/var/log/loraplex/decisions.jsonl"))
    # -- input bounds and socket access --
    tokenizer_threads: int = field(default=2, metadata=_help(
        "Threads that tokenize text prompts, off the event loop (one client's long prompts never delay "
        "another's tokens)."))
    max_queued_prompt_bytes_per_client: int = field(default=16 << 20, metadata=_help(
        "Most bytes of text prompts one client connection may have waiting for the tokenizer threads; "
        "more get a fast `overloaded` reply (one prompt alone always goes)."))
    tcp_insecure: bool = field(default=False, metadata=_help(
        "Allow tcp_listen on a non-loopback address without CURVE (anyone reaching the port can generate "
        "and read stats); without it such a daemon refuses to start."))
    admin_group: str | None = field(default=None, metadata=_help(
        "Let this group use admin.sock (mode 0660, that group; the runtime directory becomes 0710 with "
        "that group); unset = the daemon's user only (0600).", "loraplex-admin"))

    # ---- adapter files and start-up ---------------------------------------------------------------
    adapter_read_timeout_s: float = field(default=30.0, metadata=_help(
        "Seconds the daemon waits for an adapter's files to be read (hashed) before refusing it; a slow or "
        "hung filesystem never blocks the admin socket, only the one add that reads from it."))
    # ---- structured output --------------------------------------------------------------------------
    grammar_compile_timeout_s: float = field(default=5.0, metadata=_help(
        "Seconds of CPU time a structured-output grammar may take to compile (in a low-priority worker "
        "process, off the engines' steps, while its request waits in the queue; a busy host may stretch the "
        "wait to 4x this + 5 s); past it the request fails with grammar_too_complex (400)."))
    grammar_compile_memory_mb: int = field(default=1024, metadata=_help(
        "Memory (MiB of address space) one grammar compile may take beyond the worker's own; past it the "
        "request fails with grammar_too_complex."))
    grammar_compile_workers: int = field(default=1, metadata=_help(
        "Grammar compile worker processes (`loraplex-grammar`, started with the first structured-output "
        "request): how many new grammars compile at once."))

    def __post_init__(self) -> None:
        checks = Checks(self, "server.")
        checks.types()
        checks.finite("adapter_read_timeout_s", low=0.0, low_open=True)
        checks.finite("grammar_compile_timeout_s", low=0.0, high=3600.0, low_open=True)
        checks.positive("grammar_compile_memory_mb")
        if self.grammar_compile_memory_mb > 1 << 24:
            checks.fail("grammar_compile_memory_mb", "server.grammar_compile_memory_mb must be <= 16777216 (16 TiB), "
                                                     f"got {self.grammar_compile_memory_mb}")
        checks.positive("grammar_compile_workers")
        for name in ("runtime_dir", "state_dir"):
            checks.path(name)
        if self.tcp_listen is not None:
            match = TCP_ENDPOINT.fullmatch(self.tcp_listen)
            if match is None or not 1 <= int(match["port"]) <= 65535:
                checks.fail("tcp_listen", f"server.tcp_listen must look like tcp://HOST:PORT with PORT in 1..65535, "
                                          f"got {self.tcp_listen!r}")
        curve = {"tcp_curve_secret_key_file": self.tcp_curve_secret_key_file,
                 "tcp_curve_allowed_keys": self.tcp_curve_allowed_keys}
        for name, value in curve.items():
            checks.path(name)
            if value is None and any(v is not None for v in curve.values()):
                checks.fail(name, f"server.{name} must be set too: CURVE needs the server's secret key and the "
                                  "allowed client keys")
        checks.finite("drain_timeout_s", low=0.0)
        for name in ("engine_start_timeout_s", "engine_step_timeout_s", "stats_interval_s"):
            checks.finite(name, low=0.0, low_open=True)
        checks.finite("heartbeat_timeout_s", low=1.0)  # several beats, so one late beat is no false alarm
        if self.max_message_bytes < 4096:
            checks.fail("max_message_bytes", f"server.max_message_bytes must be >= 4096, got {self.max_message_bytes}")
        for name in ("max_clients_inflight", "max_requests_per_client", "engines"):
            checks.positive(name)
        checks.positive("cpu_workers", optional=True)
        if any(not d for d in self.adapter_dirs):
            checks.fail("adapter_dirs", "server.adapter_dirs must not contain empty paths")
        self._check_access(checks)

    def _check_access(self, checks: Checks) -> None:
        """The input bounds, and no open TCP port unless the operator says so."""
        checks.positive("tokenizer_threads")
        checks.positive("max_queued_prompt_bytes_per_client")
        checks.path("admin_group", "a group name or unset")
        if self.tcp_listen is not None and self.tcp_curve_secret_key_file is None and not self.tcp_insecure \
                and not is_loopback_endpoint(self.tcp_listen):
            checks.fail("tcp_listen",
                        f"server.tcp_listen {self.tcp_listen} is reachable from other hosts and has no CURVE keys, so "
                        "anyone who reaches it could generate and read stats: set server.tcp_curve_secret_key_file "
                        "and server.tcp_curve_allowed_keys, listen on 127.0.0.1, or set server.tcp_insecure = true")

    @property
    def resolved_runtime_dir(self) -> Path:
        """runtime_dir, else the ipc layer's default (from $LORAPLEX_RUNTIME_DIR / $XDG_RUNTIME_DIR)."""
        if self.runtime_dir is not None:
            return Path(self.runtime_dir).expanduser()
        from loraplex.ipc.runtime_dir import default_runtime_dir  # lazy: the ipc package imports zmq

        return default_runtime_dir()

    @property
    def resolved_state_dir(self) -> Path:
        """state_dir, else default_state_dir() from the process environment."""
        return Path(self.state_dir).expanduser() if self.state_dir is not None else default_state_dir()

    @property
    def registry_path(self) -> Path:
        """The adapter registry database inside the state directory."""
        return self.resolved_state_dir / "registry.sqlite3"


@dataclass(frozen=True, slots=True)
class LoraplexConfig:
    """Everything the daemon is configured with; `adapters` are (NAME, absolute DIR) pairs to register at start."""

    model: ModelSettings = field(default_factory=ModelSettings)
    scheduler: SchedulerSettings = field(default_factory=SchedulerSettings)
    server: ServerSettings = field(default_factory=ServerSettings)
    adapters: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        for name, cls in SECTIONS.items():
            if not isinstance(getattr(self, name), cls):
                raise ConfigError(f"{name} must be a {cls.__name__}, got {type(getattr(self, name)).__name__}", name)
        seen: set[str] = set()
        for pair in self.adapters:
            if not isinstance(pair, (tuple, list)) or len(pair) != 2 or not all(isinstance(x, str) for x in pair):
                raise ConfigError(f"adapters: each entry must be a (name, dir) pair of strings, got {pair!r}",
                                  "adapters")
            name, path = pair
            if not is_valid_adapter_name(name):
                raise ConfigError(
                    f"adapters: name {name!r} must be 1..128 chars of [A-Za-z0-9._-] (not '.' or '..')", "adapters"
                )
            if name in seen:
                raise ConfigError(f"adapters: name {name!r} is given twice", "adapters")
            if not os.path.isabs(path):
                raise ConfigError(f"adapters: directory of {name!r} must be an absolute path, got {path!r}", "adapters")
            seen.add(name)
        if self.server.engines > 1 and self.model.adapter_load_mode == LoadMode.CPU_ASSIST:
            # The CPU LoRA worker pool and its exchange buffers serve one engine.
            raise ConfigError(f"model.adapter_load_mode=cpu_assist runs one engine; server.engines is "
                              f"{self.server.engines}", "server.engines")
        object.__setattr__(self, "adapters", tuple((name, path) for name, path in self.adapters))

    def engine_spec(self, shm_instance: str | None = None) -> EngineSpec:
        """What every child process (engine, cache manager) is started with, built from these
        settings once: the [model] section's engine settings, the largest batch (the largest decode
        graph) and the adapter directories (children check every adapter file too)."""
        return EngineSpec(**{name: getattr(self.model, name) for name in ENGINE_SETTINGS},
                          max_num_seqs=self.scheduler.max_num_seqs, adapter_dirs=self.server.adapter_dirs,
                          shm_instance=shm_instance)


SECTIONS: dict[str, type] = {"model": ModelSettings, "scheduler": SchedulerSettings, "server": ServerSettings}
# The [model] settings that go to the engine as they are; the others (load_groups) stay in the daemon.
ENGINE_SETTINGS: tuple[str, ...] = tuple(f.name for f in fields(ModelSettings) if f.name in _ENGINE_FIELDS)
