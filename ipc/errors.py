"""Stable error codes and the exceptions that carry them across the wire.

Owns the vocabulary of failures every loraplex process and client agrees on.
Codes are part of the protocol: never rename or reuse one, only add. This
module must never import zmq, msgpack or anything heavier than the stdlib.
"""
from __future__ import annotations

from enum import Enum


class ErrorCode(str, Enum):
    """Stable, lowercase error codes sent in `error` replies.

    The string value is what travels on the wire; clients switch on it.
    """

    # The bytes or the map could not be understood at all.
    BAD_MESSAGE = "bad_message"
    # `v` names a protocol version this peer does not speak.
    UNSUPPORTED_VERSION = "unsupported_version"
    # `type` names no registered message type.
    UNKNOWN_TYPE = "unknown_type"
    # A field is missing, unknown, of the wrong type or out of range.
    INVALID_FIELD = "invalid_field"
    # The message or one of its parts exceeds a size limit.
    TOO_LARGE = "too_large"
    UNKNOWN_ADAPTER = "unknown_adapter"
    # An adapter's files are unreadable or incompatible with the base model.
    INVALID_ADAPTER = "invalid_adapter"
    # An add names an adapter that is already registered.
    ALREADY_EXISTS = "already_exists"
    PROMPT_TOO_LONG = "prompt_too_long"
    # The prompt fits but prompt + max_tokens exceed the model's context (vLLM answers 400).
    CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
    # A token id is negative or outside the model's vocabulary.
    INVALID_TOKEN = "invalid_token"
    # A request id is already in flight for this client.
    DUPLICATE_REQUEST = "duplicate_request"
    # A cancel or lookup names something that does not exist (anymore).
    NOT_FOUND = "not_found"
    # Admission control refused the request (queues full, SLO unreachable).
    OVERLOADED = "overloaded"
    CANCELLED = "cancelled"
    TIMEOUT = "timeout"
    # The engine serving the request died or reported a failure.
    ENGINE_FAILED = "engine_failed"
    # This request's own numbers went bad in the sampler (non-finite logits or probabilities, or
    # no token left once its options masked the vocabulary); the requests beside it went on.
    SAMPLING_ERROR = "sampling_error"
    # A structured-output grammar past the server's limits: nested deeper than the spec allows, or
    # not compiled within server.grammar_compile_timeout_s / grammar_compile_memory_mb.
    GRAMMAR_TOO_COMPLEX = "grammar_too_complex"
    SHUTTING_DOWN = "shutting_down"
    # An adapter path outside the directories the operator allowed.
    FORBIDDEN_PATH = "forbidden_path"
    # The daemon cannot be reached, its connection was lost, or it stopped
    # answering liveness probes (raised by the client library, never sent).
    UNAVAILABLE = "unavailable"
    # A bug on the daemon side; the message says what.
    INTERNAL = "internal"

    def __str__(self) -> str:
        return self.value

    @classmethod
    def parse(cls, value: str) -> ErrorCode:
        """The code whose wire value is `value`; ValueError if none is."""
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"unknown error code {value!r}") from None


class ProtocolError(ValueError):
    """A message could not be encoded, decoded or validated.

    `code` says why in the stable vocabulary; `request_id` is the request the
    offending message named, when it could be read; `identity` is the ZMQ
    routing identity of the peer that sent it (set by the socket wrapper on a
    ROUTER), so the receiver can answer that client and no other.
    Subclasses ValueError so construction-time validation reads like any
    other bad-argument error.
    """

    def __init__(
        self,
        code: ErrorCode,
        message: str,
        *,
        request_id: str | None = None,
        identity: bytes | None = None,
    ) -> None:
        if not isinstance(code, ErrorCode):
            raise TypeError(f"code must be an ErrorCode, got {type(code).__name__}")
        super().__init__(message)
        self.code = code
        self.message = message
        self.request_id = request_id
        self.identity = identity

    def __str__(self) -> str:
        return f"[{self.code.value}] {self.message}"

    def with_context(
        self, *, request_id: str | None = None, identity: bytes | None = None
    ) -> ProtocolError:
        """A copy with the request id and/or peer identity filled in."""
        return ProtocolError(
            self.code,
            self.message,
            request_id=request_id if request_id is not None else self.request_id,
            identity=identity if identity is not None else self.identity,
        )


class LoraplexError(Exception):
    """Raised by the client library when the daemon answers with an `error` reply."""

    def __init__(self, code: ErrorCode, message: str, request_id: str | None = None) -> None:
        if not isinstance(code, ErrorCode):
            raise TypeError(f"code must be an ErrorCode, got {type(code).__name__}")
        super().__init__(message)
        self.code = code
        self.message = message
        self.request_id = request_id

    def __str__(self) -> str:
        where = f" (request {self.request_id})" if self.request_id is not None else ""
        return f"[{self.code.value}] {self.message}{where}"
