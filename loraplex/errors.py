"""Request and adapter errors shared by the offline API, the engine and the daemon.

Torch-free. Each class carries a stable `code` (the same strings as the wire
protocol's error codes) so the daemon can forward it without a lookup table.
"""
from __future__ import annotations


class LoraplexRequestError(ValueError):
    """A request or adapter was refused; the engine stays usable."""

    code = "invalid_field"


class UnknownAdapterError(LoraplexRequestError, KeyError):
    code = "unknown_adapter"

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class PromptTooLongError(LoraplexRequestError):
    code = "prompt_too_long"


class InvalidTokenError(LoraplexRequestError):
    code = "invalid_token"


class DuplicateRequestError(LoraplexRequestError):
    code = "duplicate_request"


class AdapterError(LoraplexRequestError):
    """The adapter directory is unusable (format, shapes, rank, unsupported feature)."""

    code = "invalid_adapter"


class AdapterRankError(AdapterError):
    code = "invalid_adapter"


class ForbiddenAdapterPathError(AdapterError):
    """An adapter file resolves outside the allowed adapter directories (server.adapter_dirs)."""

    code = "forbidden_path"


class CapacityError(LoraplexRequestError):
    """The request can never fit in the memory pool, even alone."""

    code = "too_large"
