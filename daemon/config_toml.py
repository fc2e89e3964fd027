"""Writing the daemon's configuration as TOML: every setting with its comment and
environment variable (deploy/loraplex.toml is example_toml()), and as a plain dict for
stats (daemon/config.py declares the settings; daemon/config_load.py reads them).
"""
from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import fields
from typing import Any, get_args

from loraplex.contracts.settings import field_types
from loraplex.daemon.config import SECTIONS, LoraplexConfig
from loraplex.daemon.config_names import env_var


def config_to_dict(cfg: LoraplexConfig) -> dict[str, object]:
    """Plain dict of every setting (tuples as lists, adapters as name -> dir), for stats and debugging."""
    out: dict[str, object] = {}
    for name in SECTIONS:
        section = getattr(cfg, name)
        out[name] = {f: _plain(getattr(section, f)) for f in field_types(type(section))}
    out["adapters"] = dict(cfg.adapters)
    return out


def render_toml(cfg: LoraplexConfig, *, comments: bool = True) -> str:
    """`cfg` as a TOML file that load_config reads back to an equal config; unset options are commented out."""
    lines: list[str] = []
    if comments:
        lines += [
            "# loraplex configuration.",
            "# Precedence: built-in defaults < this file < LORAPLEX_* environment < command-line flags.",
            "# Every setting also reads LORAPLEX_<SECTION>_<FIELD>, e.g. LORAPLEX_SCHEDULER_MAX_NUM_SEQS=8.",
            "",
        ]
    for name, cls in SECTIONS.items():
        section = getattr(cfg, name)
        lines.append(f"[{name}]")
        for f in fields(cls):
            value = getattr(section, f.name)
            if comments:
                lines.append(f"# {f.metadata['help']}  (env {env_var(f'{name}.{f.name}')})")
            if value is None:
                if comments:
                    lines.append(f"# {f.name} = {_toml_value(_example(f.metadata, field_types(cls)[f.name]))}")
            else:
                lines.append(f"{f.name} = {_toml_value(value)}")
        lines.append("")
    lines.append("[adapters]")
    if comments:
        lines.append("# Adapters registered at start: NAME = \"DIR\" (relative paths are relative to this file).")
        if not cfg.adapters:
            lines.append('# qv-r8 = "/srv/adapters/qv-r8"')
    for adapter_name, adapter_dir in cfg.adapters:
        lines.append(f"{_toml_key(adapter_name)} = {_toml_value(adapter_dir)}")
    return "\n".join(lines) + "\n"


def example_toml() -> str:
    """A complete commented example file holding the defaults (deploy/loraplex.toml)."""
    return render_toml(LoraplexConfig())


def _example(metadata: Mapping[str, str], hint: Any) -> object:
    text = metadata.get("example", "")
    inner = next((a for a in get_args(hint) if a is not type(None)), str)
    return int(text) if inner is int else text


def _plain(value: object) -> object:
    return list(value) if isinstance(value, tuple) else value


_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")


def _toml_key(key: str) -> str:
    return key if _BARE_KEY.fullmatch(key) else _toml_string(key)


def _toml_string(s: str) -> str:
    escaped = []
    for ch in s:
        if ch in ('"', "\\"):
            escaped.append("\\" + ch)
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            escaped.append(f"\\u{ord(ch):04x}")
        else:
            escaped.append(ch)
    return '"' + "".join(escaped) + '"'


def _toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return f"{value:_}" if abs(value) >= 10_000 else str(value)
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, str):
        return _toml_string(value)
    if isinstance(value, tuple):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"cannot render {value!r} as TOML")
