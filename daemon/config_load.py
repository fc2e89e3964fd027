"""Loading the daemon's configuration: defaults < TOML file < LORAPLEX_* environment <
command-line flags, each value typed and checked with the place it came from
(daemon/config.py declares the settings; daemon/config_toml.py writes them).
"""
from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import tomllib

from loraplex.contracts.settings import ConfigError, convert, field_types
from loraplex.daemon.config import PATH_KEYS, SECTIONS, LoraplexConfig
from loraplex.daemon.config_names import ENV_ALIASES, ENV_CONFIG, ENV_PREFIX, env_var, parse_adapter_arg


def load_config(
    path: str | os.PathLike[str] | None,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, object] | None = None,
) -> LoraplexConfig:
    """Build the configuration from defaults < TOML file `path` < `env` < `overrides`.

    `path` None means $LORAPLEX_CONFIG when set, else no file. `env` defaults to
    os.environ; only LORAPLEX_MODEL_*, LORAPLEX_SCHEDULER_*, LORAPLEX_SERVER_* and the
    ENV_ALIASES are read (and checked: an unknown field there is an error). `overrides`
    maps "section.field" (or "adapters") to what the command line gave; a None value
    means the flag was not given. Adapters merge by name, later sources winning.
    Raises ConfigError (a ValueError) naming the key and where its value came from.
    """
    env = os.environ if env is None else env
    builder = _ConfigBuilder()
    if path is None and env.get(ENV_CONFIG):
        path = env[ENV_CONFIG]
    if path is not None:
        builder.read_file(Path(path).expanduser())
    builder.read_env(env)
    if overrides:
        builder.read_overrides(overrides)
    return builder.build()


class _ConfigBuilder:
    """Collects each setting from the sources in precedence order (file, environment, flags; a later
    one wins), typed and with the place it came from, then builds the checked LoraplexConfig, naming
    that place in any error."""

    def __init__(self) -> None:
        self.values: dict[str, dict[str, object]] = {name: {} for name in SECTIONS}
        self.where: dict[str, str] = {}
        self.adapters: dict[str, tuple[str, str]] = {}  # name -> (dir, where)

    def set(self, key: str, raw: object, where: str, *, from_text: bool, base: Path) -> None:
        section, name = key.split(".", 1)
        value = convert(key, raw, field_types(SECTIONS[section])[name], where=where, from_text=from_text)
        if key in PATH_KEYS and value is not None:
            value = tuple(_anchor(p, base) for p in value) if isinstance(value, tuple) else _anchor(value, base)
        self.values[section][name] = value
        self.where[key] = where

    def add_adapter(self, name: object, path: object, where: str, base: Path) -> None:
        if not isinstance(name, str) or not isinstance(path, str) or not path:
            raise ConfigError(f"adapters: {name!r} must map to a directory string, got {path!r} ({where})", "adapters")
        self.adapters[name] = (_anchor(path, base), where)

    def read_file(self, path: Path) -> None:
        where = f"file {path}"
        try:
            with open(path, "rb") as fh:
                data = tomllib.load(fh)
        except OSError as exc:
            raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
        base = path.resolve().parent
        valid_top = [*SECTIONS, "adapters"]
        for top, table in data.items():
            if top not in valid_top:
                raise ConfigError(f"unknown section [{top}] in {where}; valid sections: {', '.join(valid_top)}", top)
            if not isinstance(table, dict):
                raise ConfigError(f"{top} must be a table ([{top}]) in {where}, got {table!r}", top)
            if top == "adapters":
                for name, adapter_dir in table.items():
                    self.add_adapter(name, adapter_dir, where, base)
                continue
            names = field_types(SECTIONS[top])
            for name, raw in table.items():
                if name not in names:
                    raise ConfigError(
                        f"unknown setting {top}.{name} in {where}; valid [{top}] settings: {', '.join(names)}",
                        f"{top}.{name}",
                    )
                self.set(f"{top}.{name}", raw, where, from_text=False, base=base)

    def read_env(self, env: Mapping[str, str]) -> None:
        cwd = Path.cwd()
        targets: dict[str, tuple[str, str]] = {}  # key -> (variable, text)
        for var in sorted(env):
            if var in ENV_ALIASES:
                key = ENV_ALIASES[var]
            else:
                section = next((s for s in SECTIONS if var.startswith(f"{ENV_PREFIX}{s.upper()}_")), None)
                if section is None:
                    continue  # another component's variable (LORAPLEX_CACHE_DIR, LORAPLEX_CONFIG, ...)
                name = var[len(ENV_PREFIX) + len(section) + 1:].lower()
                if name not in field_types(SECTIONS[section]):
                    valid = ", ".join(env_var(f"{section}.{n}") for n in field_types(SECTIONS[section]))
                    raise ConfigError(f"unknown environment variable {var}; valid for [{section}]: {valid}", var)
                key = f"{section}.{name}"
            if key in targets and targets[key][1] != env[var]:
                other = targets[key][0]
                raise ConfigError(f"{other} and {var} both set {key}, to different values; unset one", key)
            targets[key] = (var, env[var])
        for key, (var, text) in targets.items():
            self.set(key, text, f"environment variable {var}", from_text=True, base=cwd)

    def read_overrides(self, overrides: Mapping[str, object]) -> None:
        cwd = Path.cwd()
        valid = [f"{s}.{n}" for s, cls in SECTIONS.items() for n in field_types(cls)] + ["adapters"]
        for key, raw in overrides.items():
            if key not in valid:
                raise ConfigError(f"unknown setting {key!r}; valid: {', '.join(valid)}", key)
            if raw is None:
                continue  # flag not given
            where = f"flag {key}"
            if key == "adapters":
                for name, adapter_dir in _adapter_pairs(raw, where):
                    self.add_adapter(name, adapter_dir, where, cwd)
            else:
                self.set(key, raw, where, from_text=isinstance(raw, str), base=cwd)

    def build(self) -> LoraplexConfig:
        sections: dict[str, Any] = {}
        for name, cls in SECTIONS.items():
            try:
                sections[name] = cls(**self.values[name])
            except ConfigError as exc:
                raise self._with_source(exc) from None
        try:
            return LoraplexConfig(**sections, adapters=tuple((n, d) for n, (d, _) in self.adapters.items()))
        except ConfigError as exc:
            raise self._with_source(exc) from None

    def _with_source(self, exc: ConfigError) -> ConfigError:
        where = self.where.get(exc.key or "")
        if where is None and exc.key == "adapters":
            where = ", ".join(sorted({w for _, w in self.adapters.values()})) or None
        return ConfigError(f"{exc} (from {where})" if where else str(exc), exc.key)


def _adapter_pairs(raw: object, where: str) -> list[tuple[object, object]]:
    """Adapters from a flag: a mapping, NAME=DIR strings (one or comma-separated) or (name, dir) pairs."""
    if isinstance(raw, Mapping):
        return list(raw.items())
    items = [p for p in raw.split(",") if p.strip()] if isinstance(raw, str) else raw
    if not isinstance(items, Iterable):
        raise ConfigError(f"adapters: expected NAME=DIR strings, got {raw!r} ({where})", "adapters")
    pairs: list[tuple[object, object]] = []
    for item in items:
        if isinstance(item, str):
            pairs.append(parse_adapter_arg(item))
        elif isinstance(item, (tuple, list)) and len(item) == 2:
            pairs.append((item[0], item[1]))
        else:
            raise ConfigError(f"adapters: expected NAME=DIR or (name, dir), got {item!r} ({where})", "adapters")
    return pairs


def _anchor(path: str, base: Path) -> str:
    """Expand `~` and make `path` absolute relative to `base` (lexically; symlinks stay)."""
    return os.path.abspath(os.path.join(base, os.path.expanduser(path)))
