"""Typed settings: the checks every settings dataclass of loraplex shares (the daemon's
configuration sections, the engine spec), so a value is converted and range-checked one way
wherever it is set.

`convert` turns a raw value (from TOML, JSON, or text from the environment and flags) into a
field's declared type, or raises ConfigError; `Checks` holds the range checks of one group of
settings, each failure a ConfigError naming the key ("model.dtype"). Pure Python: neither torch
nor the daemon nor the engine is imported here.
"""
from __future__ import annotations

import math
import types
from dataclasses import fields
from functools import lru_cache
from typing import Any, NoReturn, Union, get_args, get_origin, get_type_hints

_TRUE_WORDS = frozenset({"1", "true", "yes", "on"})
_FALSE_WORDS = frozenset({"0", "false", "no", "off"})
_NONE_WORDS = frozenset({"", "none", "null"})
_MISMATCH = object()


class ConfigError(ValueError):
    """A setting is unknown, of the wrong type or out of range; `key` names it ("section.field")."""

    def __init__(self, message: str, key: str | None = None) -> None:
        super().__init__(message)
        self.key = key


class Checks:
    """The range checks of one settings object whose keys start with `prefix` ("model.", "" for none)."""

    __slots__ = ("values", "prefix")

    def __init__(self, values: object, prefix: str) -> None:
        self.values = values
        self.prefix = prefix

    def key(self, name: str) -> str:
        return self.prefix + name

    def fail(self, name: str, message: str) -> NoReturn:
        raise ConfigError(message, self.key(name))

    def types(self) -> None:
        """Every field converted to its declared type (ints widen to float, lists become tuples)."""
        for name, hint in field_types(type(self.values)).items():
            value = convert(self.key(name), getattr(self.values, name), hint, where=None, from_text=False)
            object.__setattr__(self.values, name, value)

    def positive(self, name: str, *, optional: bool = False) -> None:
        value = getattr(self.values, name)
        if optional and value is None:
            return
        if value <= 0:
            self.fail(name, f"{self.key(name)} must be positive, got {value}")

    def finite(self, name: str, *, low: float, high: float = math.inf, low_open: bool = False,
               optional: bool = False) -> None:
        value = getattr(self.values, name)
        if optional and value is None:
            return
        too_low = value <= low if low_open else value < low
        if not math.isfinite(value) or too_low or value > high:
            lower = f"> {low}" if low_open else f">= {low}"
            upper = "" if math.isinf(high) else f" and <= {high}"
            self.fail(name, f"{self.key(name)} must be a finite number {lower}{upper}, got {value}")

    def choice(self, name: str, choices: tuple[str, ...]) -> None:
        value = getattr(self.values, name)
        if value not in choices:
            self.fail(name, f"{self.key(name)} must be one of {', '.join(choices)}; got {value!r}")

    def path(self, name: str, what: str = "a non-empty path or unset") -> None:
        """An optional path: unset or non-empty."""
        if getattr(self.values, name) == "":
            self.fail(name, f"{self.key(name)} must be {what}")


@lru_cache(maxsize=None)
def field_types(cls: type) -> dict[str, Any]:
    """Field name -> resolved type of a settings dataclass, in declaration order."""
    resolved = get_type_hints(cls)
    return {f.name: resolved[f.name] for f in fields(cls)}


def convert(key: str, raw: object, hint: Any, *, where: str | None, from_text: bool) -> object:
    """Check `raw` against `hint` (parsing it first when it is text from env or a flag); ConfigError if it fits not."""
    origin, args = get_origin(hint), get_args(hint)
    optional = origin in (Union, types.UnionType) and type(None) in args
    if optional:
        if raw is None or (from_text and isinstance(raw, str) and raw.strip().lower() in _NONE_WORDS):
            return None
        hint = next(a for a in args if a is not type(None))
    value = _parse_text(raw, hint) if from_text and isinstance(raw, str) else raw
    checked = _check_type(value, hint)
    if checked is _MISMATCH:
        source = f" (from {where})" if where else ""
        expected = _describe(hint) + (" or unset" if optional else "")
        raise ConfigError(f"{key}: expected {expected}, got {raw!r}{source}", key)
    return checked


def _parse_text(text: str, hint: Any) -> object:
    """Text (environment, flags) -> the hint's type; returns the text unchanged when it does not parse."""
    s = text.strip()
    try:
        if hint is bool:
            low = s.lower()
            return True if low in _TRUE_WORDS else False if low in _FALSE_WORDS else text
        if hint is int:
            return int(s)
        if hint is float:
            return float(s)
    except ValueError:
        return text
    if get_origin(hint) is tuple:
        return tuple(part.strip() for part in s.split(",") if part.strip())
    return text


def _check_type(value: object, hint: Any) -> object:
    """`value` normalised to `hint` (ints widen to float, lists become tuples), or _MISMATCH."""
    if hint is bool:
        return value if isinstance(value, bool) else _MISMATCH
    if hint is int:
        return value if isinstance(value, int) and not isinstance(value, bool) else _MISMATCH
    if hint is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        return float(value) if ok else _MISMATCH
    if hint is str:
        return value if isinstance(value, str) else _MISMATCH
    if get_origin(hint) is tuple:
        if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
            return tuple(value)
        return _MISMATCH
    raise TypeError(f"settings field type {hint!r} has no parser")  # a bug in a settings class, not bad input


def _describe(hint: Any) -> str:
    if get_origin(hint) is tuple:
        return "a list of strings (comma-separated in the environment)"
    return {bool: "a boolean (true/false, yes/no, 1/0)", int: "an integer", float: "a number", str: "a string"}[hint]
