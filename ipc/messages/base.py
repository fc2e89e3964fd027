"""The message base class and the registry of message types.

Owns PROTOCOL_VERSION, `Message`, the `register` decorator and the lookup from
wire `type` to class. A message type is declared once, as a registered frozen
slotted dataclass; its field annotations (types, and value rules attached with
Annotated) drive the checks, and its `validate()` adds cross-field rules. This
module never touches bytes or sockets.
"""
from __future__ import annotations

import dataclasses
import re
import typing
from types import MappingProxyType
from typing import Any, ClassVar, Mapping, TypeVar

from loraplex.ipc.errors import ErrorCode, ProtocolError
from loraplex.ipc.messages.fields import Checker, compile_checker

# Bump when a change would make an old peer misread a message; adding a new
# message type or an optional field with a default does not need a bump.
PROTOCOL_VERSION = 1

# Keys every wire map carries besides the fields; no field may use them.
RESERVED_KEYS = frozenset({"v", "type"})

_TYPE_NAME = re.compile(r"[a-z][a-z0-9_]{0,63}")


class Message:
    """Base of every wire message.

    Subclasses are `@register`-ed frozen slotted dataclasses with a class-level
    `TYPE`. Construction validates: each field against its annotation (its type,
    normalising ints to floats and tuples to lists, then its Annotated rules), then
    `validate()`. An invalid message therefore cannot exist, whether built locally
    or decoded.
    """

    __slots__ = ()
    TYPE: ClassVar[str] = ""

    def __post_init__(self) -> None:
        spec = _SPECS.get(type(self))
        if spec is None:
            raise TypeError(f"{type(self).__name__} is not a registered message type (missing @register?)")
        for field in spec.fields:
            value = getattr(self, field.name)
            checked = field.check(value, field.name)
            if checked is not value:
                object.__setattr__(self, field.name, checked)
        self.validate()

    def validate(self) -> None:
        """Rules between fields; raise ProtocolError. Default: none."""

    def to_fields(self) -> dict[str, Any]:
        """The field values by name, in declaration order (what goes on the wire)."""
        return {field.name: getattr(self, field.name) for field in _SPECS[type(self)].fields}


@dataclasses.dataclass(frozen=True, slots=True)
class FieldSpec:
    name: str
    check: Checker
    required: bool


@dataclasses.dataclass(frozen=True, slots=True)
class MessageSpec:
    cls: type[Message]
    fields: tuple[FieldSpec, ...]
    names: frozenset[str]
    required: frozenset[str]


_SPECS: dict[type[Message], MessageSpec] = {}
_BY_TYPE: dict[str, type[Message]] = {}

M = TypeVar("M", bound=Message)


def register(cls: type[M]) -> type[M]:
    """Class decorator: add a frozen slotted Message dataclass to the registry.

    Use as `@register` above `@dataclasses.dataclass(frozen=True, slots=True)`.
    Raises TypeError for a malformed declaration, so mistakes fail at import.
    """
    if not (isinstance(cls, type) and issubclass(cls, Message)):
        raise TypeError(f"{cls!r} must subclass Message")
    params = getattr(cls, "__dataclass_params__", None)
    if params is None or not dataclasses.is_dataclass(cls) or not params.frozen:
        raise TypeError(f"{cls.__name__} must be a frozen dataclass")
    if "__slots__" not in cls.__dict__:
        raise TypeError(f"{cls.__name__} must be declared with slots=True")
    type_name = cls.__dict__.get("TYPE")
    if not isinstance(type_name, str) or not _TYPE_NAME.fullmatch(type_name):
        raise TypeError(f"{cls.__name__}.TYPE must be a lowercase identifier, got {type_name!r}")
    if type_name in _BY_TYPE:
        raise TypeError(f"message type {type_name!r} is declared twice "
                        f"({_BY_TYPE[type_name].__name__}, {cls.__name__})")
    hints = typing.get_type_hints(cls, include_extras=True)
    specs = []
    for field in dataclasses.fields(cls):
        if field.name in RESERVED_KEYS:
            raise TypeError(f"{cls.__name__}.{field.name}: field name is reserved for the envelope")
        try:
            check = compile_checker(hints[field.name])
        except TypeError as exc:
            raise TypeError(f"{cls.__name__}.{field.name}: {exc}") from None
        required = field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING
        specs.append(FieldSpec(field.name, check, required))
    _SPECS[cls] = MessageSpec(
        cls=cls,
        fields=tuple(specs),
        names=frozenset(s.name for s in specs),
        required=frozenset(s.name for s in specs if s.required),
    )
    _BY_TYPE[type_name] = cls
    return cls


def message_types() -> Mapping[str, type[Message]]:
    """Read-only view of wire type name -> message class."""
    return MappingProxyType(_BY_TYPE)


def message_class(type_name: str) -> type[Message]:
    """The class registered for `type_name`; ProtocolError(unknown_type) if none."""
    cls = _BY_TYPE.get(type_name)
    if cls is None:
        raise ProtocolError(ErrorCode.UNKNOWN_TYPE, f"unknown message type {type_name[:64]!r}")
    return cls


def build(cls: type[M], fields: Mapping[str, Any]) -> M:
    """Construct `cls` from decoded wire fields, rejecting unknown and missing ones.

    Fields with a default may be omitted (older or hand-written senders);
    required ones may not.
    """
    spec = _SPECS[cls]
    unknown = [name for name in fields if name not in spec.names]
    if unknown:
        shown = ", ".join(repr(str(n)[:64]) for n in sorted(map(str, unknown))[:8])
        raise ProtocolError(ErrorCode.INVALID_FIELD, f"{cls.TYPE}: unknown field(s) {shown}")
    missing = spec.required.difference(fields)
    if missing:
        raise ProtocolError(ErrorCode.INVALID_FIELD, f"{cls.TYPE}: missing field(s) {', '.join(sorted(missing))}")
    return cls(**fields)
