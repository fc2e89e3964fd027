"""Gateway settings: where the daemon is, where to listen, what to expose.

Frozen data with validation that raises ValueError; the command line maps
its flags onto it. Opens nothing.
"""
from __future__ import annotations

import math
from dataclasses import Field, dataclass, field, fields
from pathlib import Path

DEFAULT_SERVED_MODEL_NAME = "loraplex-base"
# The daemon's default scheduler.max_loras_per_batch; reported as max_lora unless the daemon says otherwise.
DEFAULT_MAX_LORAS = 64


def _limit(help_text: str) -> dict[str, str]:
    """Field metadata of a limit: its help, from which gateway/cli.py makes its flag."""
    return {"help": help_text}


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    """host/port: the HTTP listener (port 0 picks a free port).
    runtime_dir: the daemon's runtime directory (None: $LORAPLEX_RUNTIME_DIR or the default).
    served_model_name: the base model's id in the API; any other `model` names an adapter.
    model_dir: the base model's HF directory, read for its chat template (None: the built-in template).
    enable_adapter_admin: serve /v1/load_lora_adapter and /v1/unload_lora_adapter (404 otherwise).
    request_timeout_s: give up on a generation after this long (None: wait while the daemon is alive).
    stats_timeout_s / stats_cache_s: how long a /metrics scrape waits for the daemon's stats, and
    for how long one snapshot answers later scrapes.
    max_loras: the max_lora label of vllm:lora_requests_info when the daemon does not report it.
    The limits on what clients send (each also a flag; README "Gateway limits") follow.
    """

    host: str = "127.0.0.1"
    port: int = 8000
    runtime_dir: Path | None = None
    served_model_name: str = DEFAULT_SERVED_MODEL_NAME
    model_dir: Path | None = None
    enable_adapter_admin: bool = False
    request_timeout_s: float | None = None
    stats_timeout_s: float = 1.0
    stats_cache_s: float = 0.5
    max_loras: int = DEFAULT_MAX_LORAS
    max_body_bytes: int | None = field(default=None, metadata=_limit(
        "largest request body in bytes; unset: sized from the daemon's max_model_len (128 prompts of token "
        "ids filling the context at 8 bytes per id, plus 1 MiB; at most, and while the context is unknown, "
        "64 MiB)"))
    header_timeout_s: float = field(default=10.0, metadata=_limit(
        "seconds a connection has to send a whole request head, from its opening or from the first byte "
        "after its previous response"))
    body_timeout_s: float = field(default=60.0, metadata=_limit(
        "seconds a request's whole body has to arrive once its head has"))
    keepalive_timeout_s: float = field(default=75.0, metadata=_limit(
        "seconds an idle keep-alive connection is kept open"))
    max_connections: int = field(default=512, metadata=_limit(
        "open client connections at most; one more is answered 503 and closed at once"))

    def __post_init__(self) -> None:
        if not isinstance(self.host, str) or not self.host:
            raise ValueError(f"host must be a non-empty string, got {self.host!r}")
        if isinstance(self.port, bool) or not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            raise ValueError(f"port must be an integer in [0, 65535], got {self.port!r}")
        name = self.served_model_name
        if not isinstance(name, str) or not name.strip() or len(name) > 256:
            raise ValueError(f"served_model_name must be a non-empty string of at most 256 chars, got {name!r}")
        if self.request_timeout_s is not None:
            _positive("request_timeout_s", self.request_timeout_s)
        _positive("stats_timeout_s", self.stats_timeout_s)
        if isinstance(self.stats_cache_s, bool) or not isinstance(self.stats_cache_s, (int, float)) \
                or not 0 <= self.stats_cache_s < 3600:
            raise ValueError(f"stats_cache_s must be in [0, 3600) seconds, got {self.stats_cache_s!r}")
        if isinstance(self.max_loras, bool) or not isinstance(self.max_loras, int) or self.max_loras < 1:
            raise ValueError(f"max_loras must be a positive integer, got {self.max_loras!r}")
        if self.max_body_bytes is not None and (isinstance(self.max_body_bytes, bool) or not isinstance(
                self.max_body_bytes, int) or self.max_body_bytes < 1024):
            raise ValueError(f"max_body_bytes must be an integer of at least 1024, got {self.max_body_bytes!r}")
        for name in ("header_timeout_s", "body_timeout_s", "keepalive_timeout_s"):
            _positive(name, getattr(self, name))
        if isinstance(self.max_connections, bool) or not isinstance(self.max_connections, int) \
                or self.max_connections < 1:
            raise ValueError(f"max_connections must be a positive integer, got {self.max_connections!r}")
        if self.model_dir is not None and not Path(self.model_dir).is_dir():
            raise ValueError(f"model_dir {self.model_dir} is not a directory")


def _positive(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")


def limit_fields() -> tuple[Field, ...]:
    """GatewayConfig's limits: the fields declared with help, each a `loraplex gateway` flag."""
    return tuple(f for f in fields(GatewayConfig) if "help" in f.metadata)
