"""The cluster's settings: how many replicas, what each one runs, where the ingress listens,
which request router places requests. Frozen data validated on construction (ValueError);
`loraplex cluster serve` and the Serve application builder both map their arguments onto it.
Opens nothing, imports no Ray.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Mapping

from loraplex.gateway.config import DEFAULT_SERVED_MODEL_NAME

# loraplex: rank-aware placement + adapter affinity (router.py); multiplex: Ray Serve's default
# router with each request's adapter as its multiplexed model id; default: Ray Serve's default
# router on plain requests (power of two choices on queue length).
ROUTERS = ("loraplex", "multiplex", "default")
APP_NAME = "loraplex"
ROUTER_OPTIONS = frozenset({"kernel", "slo_ms", "miss_ms", "host_miss_ms", "spread_queue", "profile"})
MAX_REPLICAS = 1024


@dataclass(frozen=True, slots=True)
class ClusterConfig:
    """replicas: Serve replicas, each running one loraplex daemon.
    daemon_config: the daemons' TOML config file (None: the daemon's defaults, the demo model).
    daemon_args: extra `loraplex serve` flags for every daemon (e.g. ("--num-pages", "600")).
    num_gpus_per_replica / num_cpus_per_replica: each replica's Ray resources (its daemon's
    engines run on the GPUs Ray gives it).
    router: which request router places requests on replicas (ROUTERS).
    adapter_source: where adapters named cluster-wide are resolved (a directory or s3://bucket/prefix;
    None: only the daemons' own adapters).
    http_host / http_port: the ingress's HTTP listener (Serve's proxy).
    served_model_name: the base model's id in the API.
    enable_adapter_admin: serve /v1/load_lora_adapter and /v1/unload_lora_adapter at the ingress
    (off by default, as in the gateway: they register adapters for the whole cluster).
    router_options: the loraplex router's request_router_kwargs (router.py: kernel, slo_ms,
    miss_ms, host_miss_ms, spread_queue, profile).
    stats_period_s: how often each replica reports its routing stats.
    source_check_s: how long the ingress trusts an adapter's digest before reading the source
    again (0: on every request; a replaced adapter is then never served stale).
    disk_tier_bytes: each replica's local disk tier of fetched adapters (LRU).
    """

    replicas: int = 1
    daemon_config: Path | None = None
    daemon_args: tuple[str, ...] = ()
    num_gpus_per_replica: float = 0.0
    num_cpus_per_replica: float = 0.0
    router: str = "loraplex"
    adapter_source: str | None = None
    http_host: str = "127.0.0.1"
    http_port: int = 8000
    served_model_name: str = DEFAULT_SERVED_MODEL_NAME
    enable_adapter_admin: bool = False
    stats_period_s: float = 0.5
    source_check_s: float = 0.0
    disk_tier_bytes: int = 8 << 30
    max_ongoing_requests: int = 256
    daemon_env: Mapping[str, str] = field(default_factory=dict)
    router_options: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if isinstance(self.replicas, bool) or not isinstance(self.replicas, int) \
                or not 1 <= self.replicas <= MAX_REPLICAS:
            raise ValueError(f"replicas must be an integer in [1, {MAX_REPLICAS}], got {self.replicas!r}")
        if self.daemon_config is not None and not Path(self.daemon_config).is_file():
            raise ValueError(f"daemon config {self.daemon_config} is not a file")
        if not all(isinstance(a, str) for a in self.daemon_args):
            raise ValueError("daemon_args must be strings")
        for name in ("num_gpus_per_replica", "num_cpus_per_replica"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or not 0 <= value <= 64:
                raise ValueError(f"{name} must be a number in [0, 64], got {value!r}")
        unknown = sorted(set(self.router_options) - ROUTER_OPTIONS)
        if unknown:
            raise ValueError(f"unknown router options {unknown}; known: {sorted(ROUTER_OPTIONS)}")
        if self.router not in ROUTERS:
            raise ValueError(f"unknown router {self.router!r}; choose one of {', '.join(ROUTERS)}")
        if self.adapter_source is not None and (not isinstance(self.adapter_source, str) or not self.adapter_source):
            raise ValueError(f"adapter_source must be a directory or s3://bucket/prefix, got {self.adapter_source!r}")
        if isinstance(self.http_port, bool) or not isinstance(self.http_port, int) or not 0 <= self.http_port <= 65535:
            raise ValueError(f"http_port must be an integer in [0, 65535], got {self.http_port!r}")
        if not isinstance(self.http_host, str) or not self.http_host:
            raise ValueError(f"http_host must be a non-empty string, got {self.http_host!r}")
        if not isinstance(self.stats_period_s, (int, float)) or not 0.05 <= self.stats_period_s <= 60:
            raise ValueError(f"stats_period_s must be in [0.05, 60] seconds, got {self.stats_period_s!r}")
        if not isinstance(self.source_check_s, (int, float)) or not 0 <= self.source_check_s <= 3600:
            raise ValueError(f"source_check_s must be in [0, 3600] seconds, got {self.source_check_s!r}")
        if isinstance(self.disk_tier_bytes, bool) or not isinstance(self.disk_tier_bytes, int) \
                or self.disk_tier_bytes < (1 << 20):
            raise ValueError(f"disk_tier_bytes must be an integer of at least 1 MiB, got {self.disk_tier_bytes!r}")
        if isinstance(self.adapter_source, str) and "://" in self.adapter_source \
                and not self.adapter_source.startswith("s3://"):
            raise ValueError(f"adapter_source must be a directory or s3://bucket/prefix, got {self.adapter_source!r}")
        if isinstance(self.max_ongoing_requests, bool) or not isinstance(self.max_ongoing_requests, int) \
                or not 1 <= self.max_ongoing_requests <= 65536:
            raise ValueError(f"max_ongoing_requests must be in [1, 65536], got {self.max_ongoing_requests!r}")

    @property
    def multiplexed(self) -> bool:
        """Whether requests carry their adapter as Serve's multiplexed model id (loraplex and
        multiplex routers read it; the default router must not see it, or it multiplexes too)."""
        return self.router != "default"

    def to_dict(self) -> dict[str, Any]:
        """Plain data (what crosses Ray to the deployments and what a Serve config file holds)."""
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, Path):
                value = str(value)
            elif isinstance(value, tuple):
                value = list(value)
            elif isinstance(value, Mapping):
                value = dict(value)
            out[f.name] = value
        return out

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> ClusterConfig:
        """The inverse of to_dict; also reads the strings of `serve run ... key=value` arguments."""
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(raw) - set(known))
        if unknown:
            raise ValueError(f"unknown cluster settings {unknown}; known: {sorted(known)}")
        values: dict[str, Any] = {}
        for name, value in raw.items():
            default = getattr(cls(), name)
            if name == "daemon_config" and value is not None:
                value = Path(value)
            elif name == "daemon_args":
                value = tuple(value.split()) if isinstance(value, str) else tuple(value)
            elif isinstance(value, str) and isinstance(default, bool):
                value = value.lower() in ("1", "true", "yes")
            elif isinstance(value, str) and isinstance(default, int) and not isinstance(default, bool):
                value = _parse(name, value, int)
            elif isinstance(value, str) and isinstance(default, float):
                value = _parse(name, value, float)
            values[name] = value
        return cls(**values)


def _parse(name: str, value: str, kind: type) -> Any:
    try:
        return kind(value)
    except ValueError:
        raise ValueError(f"{name} must be a {kind.__name__}, got {value!r}") from None


def serve_config(config: ClusterConfig, *, http_host: str = "0.0.0.0") -> dict[str, Any]:
    """A Ray Serve config file (`serve deploy FILE`, a KubeRay RayService's serveConfigV2) that
    deploys `config` with the application builder; JSON, which Serve's YAML reader takes as is.
    Only the settings that differ from the defaults are written as args."""
    defaults = ClusterConfig().to_dict()
    args = {k: v for k, v in config.to_dict().items()
            if v != defaults[k] and k not in ("http_host", "http_port")}
    args["replicas"] = config.replicas
    return {"http_options": {"host": http_host, "port": config.http_port},
            "applications": [{"name": APP_NAME, "route_prefix": "/", "import_path": "loraplex.cluster.app:build_app",
                              "args": args}]}
