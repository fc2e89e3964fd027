"""Range and shape rules shared by the message classes' `validate()` methods.

Owns the protocol-wide bounds (id and name lengths, token id range) and small
helpers that raise ProtocolError with the right code. Values reaching these
helpers have already passed the generic type checks.
"""
from __future__ import annotations

import re
from typing import Sequence

from loraplex.contracts.names import MAX_NAME_LEN, NAME_RULE, is_valid_name
from loraplex.ipc.errors import ErrorCode, ProtocolError

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


def check_name(field: str, value: str) -> None:
    """Adapter and policy names (loraplex.contracts.names)."""
    if not is_valid_name(value):
        raise invalid(f"{field}: must be {NAME_RULE}, got {value[:64]!r}")


def check_request_id(field: str, value: str) -> None:
    if not _REQUEST_ID.fullmatch(value):
        raise invalid(f"{field}: must be 1..{MAX_REQUEST_ID_LEN} printable ASCII chars without spaces, got {value[:64]!r}")


def check_optional_request_id(value: str | None) -> None:
    """The correlation id of a non-generate request or reply: absent or a request id."""
    if value is not None:
        check_request_id("request_id", value)


def check_int(field: str, value: int, lo: int, hi: int, code: ErrorCode = ErrorCode.INVALID_FIELD) -> None:
    if not lo <= value <= hi:
        raise invalid(f"{field}: must be in [{lo}, {hi}], got {value}", code)


def check_float(field: str, value: float, lo: float, hi: float, *, lo_open: bool = False) -> None:
    low_ok = value > lo if lo_open else value >= lo
    if not (low_ok and value <= hi):
        bracket = "(" if lo_open else "["
        raise invalid(f"{field}: must be in {bracket}{lo}, {hi}], got {value}")


def check_len(field: str, value: Sequence[object], lo: int, hi: int) -> None:
    if not lo <= len(value) <= hi:
        raise invalid(f"{field}: length must be in [{lo}, {hi}], got {len(value)}")


def check_token_ids(field: str, ids: Sequence[int], *, min_len: int = 0, max_len: int) -> None:
    """Length bounds, then every id in [0, MAX_TOKEN_ID] (code invalid_token)."""
    check_len(field, ids, min_len, max_len)
    # min/max run in C; this matters for million-token prompts.
    if ids and (min(ids) < 0 or max(ids) > MAX_TOKEN_ID):
        bad = next(t for t in ids if not 0 <= t <= MAX_TOKEN_ID)
        raise invalid(f"{field}: token id {bad} outside [0, {MAX_TOKEN_ID}]", ErrorCode.INVALID_TOKEN)


def check_path(field: str, value: str) -> None:
    """An absolute filesystem path on the daemon's host, without NUL bytes."""
    if not 1 <= len(value) <= MAX_PATH_LEN:
        raise invalid(f"{field}: length must be in [1, {MAX_PATH_LEN}], got {len(value)}")
    if "\x00" in value:
        raise invalid(f"{field}: must not contain NUL bytes")
    if not value.startswith("/"):
        raise invalid(f"{field}: must be an absolute path (the daemon's working directory is not yours), got {value[:64]!r}")
