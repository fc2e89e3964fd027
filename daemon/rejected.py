"""A refusal with a stable error code: what the serving core raises when a request or an
admin order cannot be carried out. The server turns it into an error reply."""
from __future__ import annotations

from loraplex.ipc.errors import ErrorCode


class Rejected(Exception):
    """A request or admin order is refused with a stable error code."""

    def __init__(self, code: ErrorCode | str, message: str) -> None:
        super().__init__(message)
        self.code = ErrorCode(code).value
        self.message = message
