"""msgpack encoding and bounded, validating decoding of protocol messages.

Owns the bytes <-> Message boundary: size limits, msgpack unpacker limits,
rejection of every ext type, the `v`/`type` envelope and the mapping of every
failure onto a ProtocolError with a stable code. `decode` never lets any
other exception escape, so a receive loop needs exactly one except clause.
Never pickles, never touches sockets.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import msgpack

from loraplex.ipc.errors import ErrorCode, ProtocolError
from loraplex.ipc.protocol import PROTOCOL_VERSION, RESERVED_KEYS, Message, build, is_valid_request_id, message_class

DEFAULT_MAX_MESSAGE_BYTES = 8 << 20


@dataclass(frozen=True, slots=True)
class DecodeLimits:
    """Bounds applied before and while unpacking one message body.

    max_message_bytes is also what the socket wrapper sets as ZMQ MAXMSGSIZE,
    so oversized frames are dropped by libzmq before Python sees them.
    max_array_len is per array: a million-token prompt fits, a billion-entry
    header is refused before allocation.
    """

    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    max_str_len: int = DEFAULT_MAX_MESSAGE_BYTES
    max_bin_len: int = DEFAULT_MAX_MESSAGE_BYTES
    max_array_len: int = 1 << 20
    max_map_len: int = 1 << 16

    def __post_init__(self) -> None:
        for name in ("max_message_bytes", "max_str_len", "max_bin_len", "max_array_len", "max_map_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"DecodeLimits.{name} must be a positive int, got {value!r}")
        # msgpack and libzmq take these as signed 64-bit / ssize_t values.
        if self.max_message_bytes > 2**62:
            raise ValueError(f"DecodeLimits.max_message_bytes too large: {self.max_message_bytes}")


DEFAULT_LIMITS = DecodeLimits()


class _ExtTypeRejected(Exception):
    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


def _reject_ext(code: int, data: bytes) -> Any:
    # Application ext types could smuggle arbitrary payloads past the field
    # checks; none are part of the protocol.
    raise _ExtTypeRejected(code)


_RECORD_FIELDS: dict[type, tuple[str, ...]] = {}


def _pack_record(obj: Any) -> Any:
    # msgpack calls this for types it does not know: nested records (frozen
    # dataclasses declared as field types) go out as maps of their fields.
    names = _RECORD_FIELDS.get(type(obj))
    if names is None:
        if not dataclasses.is_dataclass(obj) or isinstance(obj, type):
            raise TypeError(f"cannot encode a {type(obj).__name__}")
        # dataclasses.fields() builds a tuple per call: a 256-row plan calls this ~600 times.
        names = _RECORD_FIELDS[type(obj)] = tuple(f.name for f in dataclasses.fields(obj))
    return {name: getattr(obj, name) for name in names}


def encode(msg: Message, limits: DecodeLimits = DEFAULT_LIMITS) -> bytes:
    """The wire bytes of `msg`: one msgpack map with `v`, `type` and every field.

    Raises ProtocolError(too_large) when the result exceeds what a peer with
    the same limits would accept, so the sender fails instead of the peer
    silently dropping it.
    """
    if not isinstance(msg, Message):
        raise TypeError(f"encode() takes a Message, got {type(msg).__name__}")
    body: dict[str, Any] = {"v": PROTOCOL_VERSION, "type": msg.TYPE}
    body.update(msg.to_fields())
    try:
        data = msgpack.packb(body, use_bin_type=True, default=_pack_record)
    except (TypeError, ValueError, OverflowError) as exc:
        # Only reachable when a list field was mutated after validation.
        raise ProtocolError(ErrorCode.INVALID_FIELD, f"{msg.TYPE}: cannot encode: {exc}") from None
    if len(data) > limits.max_message_bytes:
        raise ProtocolError(
            ErrorCode.TOO_LARGE,
            f"{msg.TYPE}: encoded size {len(data)} exceeds the {limits.max_message_bytes}-byte limit",
        )
    return data


def _unpack(data: Any, limits: DecodeLimits) -> Any:
    try:
        view = memoryview(data)
    except TypeError:
        raise ProtocolError(ErrorCode.BAD_MESSAGE, f"expected a bytes-like body, got {type(data).__name__}") from None
    if view.nbytes > limits.max_message_bytes:
        raise ProtocolError(
            ErrorCode.TOO_LARGE, f"message of {view.nbytes} bytes exceeds the {limits.max_message_bytes}-byte limit"
        )
    if view.nbytes == 0:
        raise ProtocolError(ErrorCode.BAD_MESSAGE, "empty message")
    try:
        return msgpack.unpackb(
            view,
            raw=False,
            use_list=True,
            strict_map_key=True,
            ext_hook=_reject_ext,
            max_str_len=limits.max_str_len,
            max_bin_len=limits.max_bin_len,
            max_array_len=limits.max_array_len,
            max_map_len=limits.max_map_len,
            max_ext_len=limits.max_message_bytes,
        )
    except _ExtTypeRejected as exc:
        raise ProtocolError(ErrorCode.BAD_MESSAGE, f"msgpack ext type {exc.code} is not allowed") from None
    except MemoryError:
        raise ProtocolError(ErrorCode.TOO_LARGE, "message too large to unpack") from None
    except ValueError as exc:
        # msgpack reports its length limits as plain ValueErrors; everything
        # else (truncated input, bad UTF-8, extra data, bad format, nesting
        # too deep, non-str map keys) is a malformed message.
        text = str(exc)
        if "exceeds max_" in text:
            raise ProtocolError(ErrorCode.TOO_LARGE, f"msgpack limit: {text[:200]}") from None
        detail = f": {text[:200]}" if text else ""
        raise ProtocolError(ErrorCode.BAD_MESSAGE, f"invalid msgpack ({type(exc).__name__}){detail}") from None
    except Exception as exc:
        raise ProtocolError(ErrorCode.BAD_MESSAGE, f"invalid msgpack ({type(exc).__name__})") from None


def _request_id_hint(body: dict[Any, Any]) -> str | None:
    """The message's request id if it is readable, so errors can name it."""
    rid = body.get("request_id")
    return rid if is_valid_request_id(rid) else None


def _envelope_class(body: dict[Any, Any]) -> type[Message]:
    if "v" not in body:
        raise ProtocolError(ErrorCode.BAD_MESSAGE, "missing protocol version 'v'")
    version = body["v"]
    if isinstance(version, bool) or not isinstance(version, int):
        raise ProtocolError(ErrorCode.BAD_MESSAGE, f"'v' must be an int, got {type(version).__name__}")
    if version != PROTOCOL_VERSION:
        raise ProtocolError(
            ErrorCode.UNSUPPORTED_VERSION,
            f"protocol version {version} is not supported (this peer speaks {PROTOCOL_VERSION})",
        )
    if "type" not in body:
        raise ProtocolError(ErrorCode.BAD_MESSAGE, "missing message 'type'")
    type_name = body["type"]
    if not isinstance(type_name, str):
        raise ProtocolError(ErrorCode.BAD_MESSAGE, f"'type' must be a str, got {type(type_name).__name__}")
    return message_class(type_name)


def decode(data: Any, limits: DecodeLimits = DEFAULT_LIMITS) -> Message:
    """The validated Message in `data` (bytes, bytearray, memoryview, zmq buffer).

    Raises ProtocolError, and nothing else, with `request_id` set when the
    body named a readable one.
    """
    body = _unpack(data, limits)
    if not isinstance(body, dict):
        raise ProtocolError(ErrorCode.BAD_MESSAGE, f"top level must be a map, got {type(body).__name__}")
    request_id = _request_id_hint(body)
    try:
        cls = _envelope_class(body)
        fields = {key: value for key, value in body.items() if key not in RESERVED_KEYS}
        return build(cls, fields)
    except ProtocolError as exc:
        raise exc.with_context(request_id=request_id) from None
    except RecursionError:
        # Only self-referencing records can nest this deep.
        raise ProtocolError(ErrorCode.BAD_MESSAGE, "message nested too deeply", request_id=request_id) from None
    except Exception as exc:
        # A validator bug, not the sender's fault; still never escapes as
        # anything but a ProtocolError.
        raise ProtocolError(
            ErrorCode.INTERNAL, f"validation failed unexpectedly ({type(exc).__name__}: {str(exc)[:200]})",
            request_id=request_id,
        ) from None
