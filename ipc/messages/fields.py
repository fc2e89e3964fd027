"""Checkers compiled from dataclass field annotations: a field is declared once,
with its type and its value rules, and this module turns that into one function.

Owns the mapping from a field's declared type to a function that checks (and
normalises) a value of that field. Supported grammar: int, float, str, bool,
bytes, object (any plain msgpack value), Literal of strs, `X | None` and other
unions, list[T], dict[str, T], nested frozen dataclasses ("records", sent as maps
of their fields) for structured payloads such as step plans, and `Annotated[T,
rule, ...]`: T's check, then each Rule (ipc/messages/checks.py declares them) on
the value. Cross-field rules stay in a message's `validate()`.
"""
from __future__ import annotations

import dataclasses
import math
import types
import typing
from abc import ABC, abstractmethod
from typing import Annotated, Any, Callable, Literal, Union

import msgpack

from loraplex.ipc.errors import ErrorCode, ProtocolError

# check(value, path) -> normalised value, or raises ProtocolError.
Checker = Callable[[Any, str], Any]

# Nesting allowed inside free-form `object` fields (stats payloads). The
# unpacker already stops at its own stack limit; this keeps our recursion far
# below Python's.
MAX_OBJECT_DEPTH = 16


def _kind(value: object) -> str:
    return "None" if value is None else type(value).__name__


class FieldTypeError(ProtocolError):
    """The value has the wrong type (as opposed to a bad value of the right type)."""


def _mismatch(path: str, expected: str, value: object) -> ProtocolError:
    if isinstance(value, (msgpack.Timestamp, msgpack.ExtType)):
        # The timestamp ext (-1) is decoded by msgpack itself, never through
        # ext_hook, so it surfaces here; report it like every other ext type.
        return FieldTypeError(ErrorCode.BAD_MESSAGE, f"{path}: msgpack ext types are not allowed")
    return FieldTypeError(ErrorCode.INVALID_FIELD, f"{path}: expected {expected}, got {_kind(value)}")


def _check_int(value: Any, path: str) -> int:
    if type(value) is int:  # the common case first: checks run per field of every row of every step
        return value
    # bool is a subclass of int; on the wire it is a different type.
    if isinstance(value, bool) or not isinstance(value, int):
        raise _mismatch(path, "int", value)
    return value if type(value) is int else int(value)


def _check_float(value: Any, path: str) -> float:
    if type(value) is float and math.isfinite(value):
        return value
    # Ints are accepted and widened: hand-written clients send `1` for 1.0.
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _mismatch(path, "float", value)
    result = float(value)
    if not math.isfinite(result):
        raise ProtocolError(ErrorCode.INVALID_FIELD, f"{path}: must be finite, got {result}")
    return result


def _check_str(value: Any, path: str) -> str:
    if type(value) is str:
        return value
    if not isinstance(value, str):
        raise _mismatch(path, "str", value)
    # str.__str__ turns a str subclass (e.g. a str Enum) into its plain value.
    return value if type(value) is str else str.__str__(value)


def _check_bool(value: Any, path: str) -> bool:
    if type(value) is not bool:
        raise _mismatch(path, "bool", value)
    return value


def _check_bytes(value: Any, path: str) -> bytes:
    if isinstance(value, (bytearray, memoryview)):
        return bytes(value)
    if not isinstance(value, bytes):
        raise _mismatch(path, "bytes", value)
    return value


def _check_none(value: Any, path: str) -> None:
    if value is not None:
        raise _mismatch(path, "None", value)
    return None


def _check_plain(value: Any, path: str, depth: int = 0) -> Any:
    """Any msgpack-native value: None, bool, int, finite float, str, bytes, list, str-keyed map."""
    if depth > MAX_OBJECT_DEPTH:
        raise ProtocolError(ErrorCode.INVALID_FIELD, f"{path}: nested deeper than {MAX_OBJECT_DEPTH}")
    if value is None or isinstance(value, (bool, int, str, bytes)):
        return value
    if isinstance(value, float):
        return _check_float(value, path)
    if isinstance(value, (list, tuple)):
        return [_check_plain(item, f"{path}[{i}]", depth + 1) for i, item in enumerate(value)]
    if isinstance(value, dict):
        out = {}
        for key, item in value.items():
            if not isinstance(key, str):
                raise _mismatch(f"{path} key", "str", key)
            out[key] = _check_plain(item, f"{path}.{key}", depth + 1)
        return out
    raise _mismatch(path, "a plain msgpack value", value)


class Rule(ABC):
    """A value rule of one field, attached to its type with Annotated: called with the
    type-checked value and its path, raises ProtocolError. A rule that bounds a list's
    length also overrides `bound`, which sees a list before its items are checked, so an
    over-long list is refused before any per-item work."""

    __slots__ = ()

    def bound(self, value: list[Any] | tuple[Any, ...], path: str) -> None:
        """Checks on a list (or tuple) whose items are not checked yet. Default: none."""

    @abstractmethod
    def __call__(self, value: Any, path: str) -> None:
        """Check the type-checked `value` at `path`; raise ProtocolError when it breaks the rule."""


def _annotated_checker(base: Checker, rules: tuple[Rule, ...]) -> Checker:
    early = tuple(rule for rule in rules if type(rule).bound is not Rule.bound)
    if not early and len(rules) == 1:
        (rule,) = rules

        def check_one_rule(value: Any, path: str) -> Any:  # the usual case, one call less
            value = base(value, path)
            rule(value, path)
            return value

        return check_one_rule

    def check_annotated(value: Any, path: str) -> Any:
        if early and isinstance(value, (list, tuple)):
            for rule in early:
                rule.bound(value, path)
        value = base(value, path)
        for rule in rules:
            rule(value, path)
        return value

    return check_annotated


_INT_ONLY = frozenset({int})

_SCALARS: dict[object, Checker] = {
    int: _check_int,
    float: _check_float,
    str: _check_str,
    bool: _check_bool,
    bytes: _check_bytes,
    type(None): _check_none,
    object: _check_plain,
    Any: _check_plain,
}


def _list_checker(item: Checker, item_type: object) -> Checker:
    if item_type is int:
        # Token id lists reach a million entries: keep the common case to one
        # C-level pass and fall back to the per-item path only on failure.
        def check_int_list(value: Any, path: str) -> list[int]:
            if not isinstance(value, (list, tuple)):
                raise _mismatch(path, "list", value)
            # set(map(type, ...)) runs in C, about twice as fast as all(...).
            if set(map(type, value)) <= _INT_ONLY:
                return value if type(value) is list else list(value)
            return [_check_int(x, f"{path}[{i}]") for i, x in enumerate(value)]

        return check_int_list

    def check_list(value: Any, path: str) -> list[Any]:
        if not isinstance(value, (list, tuple)):
            raise _mismatch(path, "list", value)
        try:  # each item's own path is formatted only for the error (a step plan's rows: thousands a step)
            out = [item(x, path) for x in value]
        except ProtocolError as fast:
            for i, x in enumerate(value):
                item(x, f"{path}[{i}]")
            raise fast
        # Keep the caller's list object when nothing needed normalising.
        if type(value) is list and all(a is b for a, b in zip(out, value)):
            return value
        return out

    return check_list


def _dict_checker(item: Checker) -> Checker:
    def check_dict(value: Any, path: str) -> dict[str, Any]:
        if not isinstance(value, dict):
            raise _mismatch(path, "map", value)
        out = {}
        for key, x in value.items():
            if not isinstance(key, str):
                raise _mismatch(f"{path} key", "str", key)
            out[key] = item(x, f"{path}.{key}")
        return out

    return check_dict


def _union_checker(options: tuple[Checker, ...], names: str, optional: bool) -> Checker:
    def check_union(value: Any, path: str) -> Any:
        if value is None and optional:
            return None  # the common `X | None` left unset, without a failed try of X
        for option in options:
            try:
                return option(value, path)
            except FieldTypeError:
                continue
            # Any other ProtocolError means the type matched but the value is
            # bad (a NaN float): that is the error worth reporting.
        raise _mismatch(path, names, value)

    return check_union


def _literal_checker(allowed: tuple[object, ...]) -> Checker:
    def check_literal(value: Any, path: str) -> Any:
        if isinstance(value, str) and value in allowed:
            return str.__str__(value)
        shown = ", ".join(repr(a) for a in allowed)
        if isinstance(value, str):
            raise ProtocolError(ErrorCode.INVALID_FIELD, f"{path}: must be one of {shown}, got {value!r}")
        raise _mismatch(path, f"one of {shown}", value)

    return check_literal


_RECORD_CHECKERS: dict[type, Checker] = {}


def _record_fields(cls: type) -> list[tuple[str, Checker, bool]]:
    hints = typing.get_type_hints(cls, include_extras=True)
    out = []
    for f in dataclasses.fields(cls):
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        out.append((f.name, compile_checker(hints[f.name]), required))
    return out


def _record_checker(cls: type) -> Checker:
    """A nested frozen dataclass: an instance is checked field by field, a
    decoded map must carry exactly its fields (defaults may be omitted).
    The record's own __post_init__ may raise ValueError for range rules."""
    cached = _RECORD_CHECKERS.get(cls)
    if cached is not None:
        return cached
    params = getattr(cls, "__dataclass_params__", None)
    if params is None or not params.frozen:
        raise TypeError(f"nested record {cls.__name__} must be a frozen dataclass")
    # Filled right below, after the checker is cached, so a record whose
    # fields refer back to itself finds its own checker instead of recursing.
    holder: list[tuple[tuple[str, Checker, bool], ...]] = []
    keys: list[tuple[frozenset[str], frozenset[str]]] = []  # (every field name, the required ones)

    def check_record(value: Any, path: str) -> Any:
        specs = holder[0]
        if isinstance(value, cls):
            try:  # field paths are formatted only for the error, as in check_list
                for name, check, _ in specs:
                    current = getattr(value, name)
                    checked = check(current, path)
                    if checked is not current:
                        object.__setattr__(value, name, checked)
            except ProtocolError as fast:
                for name, check, _ in specs:
                    check(getattr(value, name), f"{path}.{name}")
                raise fast
            return value
        if not isinstance(value, dict):
            raise _mismatch(path, f"{cls.__name__} map", value)
        names, required = keys[0]
        if not (value.keys() <= names and required <= value.keys()):
            unknown = [str(k)[:64] for k in value if k not in names]
            if unknown:
                raise ProtocolError(ErrorCode.INVALID_FIELD,
                                    f"{path}: unknown field(s) {', '.join(sorted(unknown)[:8])}")
            missing = [name for name, _, required in specs if required and name not in value]
            raise ProtocolError(ErrorCode.INVALID_FIELD, f"{path}: missing field(s) {', '.join(missing)}")
        try:
            kwargs = {name: check(value[name], path) for name, check, _ in specs if name in value}
        except ProtocolError as fast:
            for name, check, _ in specs:
                if name in value:
                    check(value[name], f"{path}.{name}")
            raise fast
        try:
            return cls(**kwargs)
        except ProtocolError:
            raise
        except (TypeError, ValueError) as exc:
            raise ProtocolError(ErrorCode.INVALID_FIELD, f"{path}: {exc}") from None

    _RECORD_CHECKERS[cls] = check_record
    try:
        holder.append(tuple(_record_fields(cls)))
        keys.append((frozenset(name for name, _, _ in holder[0]),
                     frozenset(name for name, _, required in holder[0] if required)))
    except Exception:
        del _RECORD_CHECKERS[cls]
        raise
    return check_record


def compile_checker(hint: object) -> Checker:
    """The checker for one resolved type annotation; TypeError if unsupported."""
    if hint in _SCALARS:
        return _SCALARS[hint]
    if hint is None:
        return _check_none
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin is Annotated:
        rules = tuple(a for a in hint.__metadata__ if isinstance(a, Rule))
        if len(rules) != len(hint.__metadata__):
            raise TypeError(f"Annotated metadata must be Rules, got {hint!r}")
        return _annotated_checker(compile_checker(args[0]), rules)
    if origin is Literal:
        if not all(isinstance(a, str) for a in args):
            raise TypeError(f"only Literal of str is supported, got {hint!r}")
        return _literal_checker(args)
    if origin in (Union, types.UnionType):
        options = tuple(compile_checker(a) for a in args)
        names = " | ".join("None" if a is type(None) else getattr(a, "__name__", repr(a)) for a in args)
        return _union_checker(options, names, type(None) in args)
    if origin is list and len(args) == 1:
        return _list_checker(compile_checker(args[0]), args[0])
    if origin is dict and len(args) == 2:
        if args[0] is not str:
            raise TypeError(f"dict keys must be str, got {hint!r}")
        return _dict_checker(compile_checker(args[1]))
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return _record_checker(hint)
    raise TypeError(f"unsupported message field type {hint!r}")
