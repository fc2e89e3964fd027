"""The value rules of message fields, and the protocol-wide bounds they use.

A field declares its rules once, beside its type: `max_tokens: Annotated[int,
InRange(1, MAX_NEW_TOKENS)] | None = 64`. Each rule is a small frozen object that
raises ProtocolError with the field's path and the right code; the field checker
(fields.py) runs it after the type check, so a rule sees a value of its type.
Owns the bounds (id and name lengths, token id range) and the common field types
(RequestId, Name, FilePath).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Annotated, Any, Sized

from loraplex.contracts.names import NAME_RULE, is_valid_name
from loraplex.ipc.errors import ErrorCode, ProtocolError
from loraplex.ipc.messages.fields import Rule

MAX_REQUEST_ID_LEN = 128
MAX_PATH_LEN = 4096
# Token ids are int32 in every tokenizer and kernel we feed.
MAX_TOKEN_ID = 2**31 - 1
INT32_MIN = -(2**31)
INT32_MAX = 2**31 - 1
UINT63_MAX = 2**63 - 1

# Printable ASCII without space: safe in logs, file names and the console.
_REQUEST_ID = re.compile(r"[!-~]{1,%d}" % MAX_REQUEST_ID_LEN)


def invalid(message: str, code: ErrorCode = ErrorCode.INVALID_FIELD) -> ProtocolError:
    return ProtocolError(code, message)


def is_valid_request_id(value: object) -> bool:
    return isinstance(value, str) and bool(_REQUEST_ID.fullmatch(value))


@dataclass(frozen=True, slots=True)
class InRange(Rule):
    """An int in [lo, hi]; `off`, when given, is also accepted and means "disabled"."""

    lo: int
    hi: int
    off: int | None = None

    def __call__(self, value: int, path: str) -> None:
        if not self.lo <= value <= self.hi and value != self.off:
            label = path if self.off is None else f"{path} ({self.off} disables)"
            raise invalid(f"{label}: must be in [{self.lo}, {self.hi}], got {value}")


@dataclass(frozen=True, slots=True)
class AtLeast(Rule):
    """A number >= lo."""

    lo: int

    def __call__(self, value: float, path: str) -> None:
        if value < self.lo:
            raise invalid(f"{path}: must be >= {self.lo}, got {value}")


@dataclass(frozen=True, slots=True)
class InInterval(Rule):
    """A float in [lo, hi], or (lo, hi] with lo_open."""

    lo: float
    hi: float
    lo_open: bool = False

    def __call__(self, value: float, path: str) -> None:
        low_ok = value > self.lo if self.lo_open else value >= self.lo
        if not (low_ok and value <= self.hi):
            raise invalid(f"{path}: must be in {'(' if self.lo_open else '['}{self.lo}, {self.hi}], got {value}")


@dataclass(frozen=True, slots=True)
class Length(Rule):
    """A str or list of lo..hi entries (a list's before its items are checked)."""

    lo: int
    hi: int

    def bound(self, value: Sized, path: str) -> None:
        if not self.lo <= len(value) <= self.hi:
            raise invalid(f"{path}: length must be in [{self.lo}, {self.hi}], got {len(value)}")

    __call__ = bound


@dataclass(frozen=True, slots=True)
class TokenIds(Length):
    """A list of lo..hi token ids, each in [0, MAX_TOKEN_ID] (code invalid_token)."""

    def __call__(self, ids: list[int], path: str) -> None:
        # The length was bounded (bound) before the items were type-checked. min/max run
        # in C; this matters for million-token prompts.
        if ids and (min(ids) < 0 or max(ids) > MAX_TOKEN_ID):
            bad = next(t for t in ids if not 0 <= t <= MAX_TOKEN_ID)
            raise invalid(f"{path}: token id {bad} outside [0, {MAX_TOKEN_ID}]", ErrorCode.INVALID_TOKEN)


@dataclass(frozen=True, slots=True)
class OneOf(Rule):
    """A str among `values` (a set too large to spell as a Literal)."""

    values: frozenset[str]
    what: str = "value"

    def __call__(self, value: str, path: str) -> None:
        if value not in self.values:
            raise invalid(f"{path}: unknown {self.what} {value[:64]!r}")


@dataclass(frozen=True, slots=True)
class RequestIdRule(Rule):
    def __call__(self, value: str, path: str) -> None:
        if not _REQUEST_ID.fullmatch(value):
            raise invalid(f"{path}: must be 1..{MAX_REQUEST_ID_LEN} printable ASCII chars without spaces, "
                          f"got {value[:64]!r}")


@dataclass(frozen=True, slots=True)
class NameRule(Rule):
    """Adapter and policy names (loraplex.contracts.names)."""

    def __call__(self, value: str, path: str) -> None:
        if not is_valid_name(value):
            raise invalid(f"{path}: must be {NAME_RULE}, got {value[:64]!r}")


@dataclass(frozen=True, slots=True)
class AbsolutePath(Rule):
    """An absolute filesystem path on the daemon's host, without NUL bytes."""

    def __call__(self, value: str, path: str) -> None:
        Length(1, MAX_PATH_LEN)(value, path)
        if "\x00" in value:
            raise invalid(f"{path}: must not contain NUL bytes")
        if not value.startswith("/"):
            raise invalid(f"{path}: must be an absolute path (the daemon's working directory is not yours), "
                          f"got {value[:64]!r}")


@dataclass(frozen=True, slots=True)
class Checked(Rule):
    """A rule given as a function that raises ValueError (e.g. a shared-memory name check)."""

    check: Any

    def __call__(self, value: Any, path: str) -> None:
        try:
            self.check(value)
        except ValueError as exc:
            raise invalid(f"{path}: {exc}") from None


RequestId = Annotated[str, RequestIdRule()]
Name = Annotated[str, NameRule()]
FilePath = Annotated[str, AbsolutePath()]
