"""The names the daemon's settings go by outside their dataclasses (daemon/config.py): the
LORAPLEX_* environment variables and their short aliases, the default state directory, the
`--adapter NAME=DIR` flag, and which tcp:// endpoints listen on loopback only. Stdlib only.
"""
from __future__ import annotations

import ipaddress
import os
import re
from collections.abc import Mapping
from pathlib import Path

from loraplex.contracts.settings import ConfigError

ENV_PREFIX = "LORAPLEX_"
ENV_CONFIG = "LORAPLEX_CONFIG"
ENV_STATE_DIR = "LORAPLEX_STATE_DIR"
# Short spellings for the settings people set most; each maps onto one "section.field".
ENV_ALIASES: dict[str, str] = {
    "LORAPLEX_MODEL": "model.model",
    "LORAPLEX_RUNTIME_DIR": "server.runtime_dir",
    ENV_STATE_DIR: "server.state_dir",
}
TCP_ENDPOINT = re.compile(r"tcp://(?P<host>\*|\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):(?P<port>\d{1,5})")


def default_state_dir(env: Mapping[str, str] | None = None) -> Path:
    """$LORAPLEX_STATE_DIR, else $XDG_STATE_HOME/loraplex, else ~/.local/state/loraplex."""
    env = os.environ if env is None else env
    if env.get(ENV_STATE_DIR):
        return Path(env[ENV_STATE_DIR]).expanduser()
    if env.get("XDG_STATE_HOME"):
        return Path(env["XDG_STATE_HOME"]).expanduser() / "loraplex"
    return Path.home() / ".local" / "state" / "loraplex"


def is_loopback_endpoint(endpoint: str) -> bool:
    """Whether a tcp:// endpoint listens on loopback only (localhost, 127.0.0.0/8, ::1); `*`, other
    addresses, host and interface names count as reachable from elsewhere."""
    match = TCP_ENDPOINT.fullmatch(endpoint)
    if match is None:
        return False
    host = match["host"].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def env_var(key: str) -> str:
    """The environment variable of "section.field", e.g. LORAPLEX_SCHEDULER_MAX_NUM_SEQS."""
    return ENV_PREFIX + key.replace(".", "_").upper()


def parse_adapter_arg(text: str) -> tuple[str, str]:
    """Split a `--adapter NAME=DIR` argument; ValueError if either side is missing."""
    name, sep, path = text.partition("=")
    name, path = name.strip(), path.strip()
    if not sep or not name or not path:
        raise ConfigError(f"adapter must be given as NAME=DIR, got {text!r}", "adapters")
    return name, path
