"""OpenAI-style errors: the ApiError every handler raises, its JSON body
`{"error": {"message", "type", "param", "code"}}`, and the mapping from the
daemon's stable LoraplexError codes to HTTP statuses.

Pure data and aiohttp responses; never talks to the daemon.
"""
from __future__ import annotations

from aiohttp import web

from loraplex.ipc.errors import ErrorCode, LoraplexError, ProtocolError

# daemon code -> (HTTP status, OpenAI error code); codes not listed are 500s.
_DAEMON_STATUS: dict[ErrorCode, tuple[int, str]] = {
    ErrorCode.UNKNOWN_ADAPTER: (404, "model_not_found"),
    ErrorCode.NOT_FOUND: (404, "not_found"),
    ErrorCode.PROMPT_TOO_LONG: (400, "context_length_exceeded"),
    ErrorCode.CONTEXT_LENGTH_EXCEEDED: (400, "context_length_exceeded"),  # vLLM: 400 for prompt + max_tokens
    ErrorCode.INVALID_TOKEN: (400, "invalid_token"),
    ErrorCode.INVALID_FIELD: (400, "invalid_value"),
    ErrorCode.TOO_LARGE: (400, "too_large"),
    ErrorCode.BAD_MESSAGE: (400, "invalid_value"),
    ErrorCode.INVALID_ADAPTER: (400, "invalid_adapter"),
    ErrorCode.ALREADY_EXISTS: (400, "already_exists"),  # vLLM answers a repeated load with 400 too
    ErrorCode.FORBIDDEN_PATH: (403, "forbidden_path"),
    # The request's own options made its numbers bad (README, "Sampling numerics"): the same
    # request fails the same way again, so a 4xx, not a 5xx a client would retry.
    ErrorCode.SAMPLING_ERROR: (400, "sampling_error"),
    ErrorCode.GRAMMAR_TOO_COMPLEX: (400, "grammar_too_complex"),  # past the server's structured-output limits
    ErrorCode.OVERLOADED: (429, "overloaded"),
    ErrorCode.UNAVAILABLE: (503, "unavailable"),
    ErrorCode.ENGINE_FAILED: (503, "engine_failed"),
    ErrorCode.SHUTTING_DOWN: (503, "shutting_down"),
    ErrorCode.TIMEOUT: (504, "timeout"),
}


def error_type(status: int) -> str:
    """The OpenAI `type` for an HTTP status."""
    if status >= 500:
        return "server_error"
    if status == 429:
        return "rate_limit_error"
    if status == 403:
        return "permission_error"
    return "invalid_request_error"


class ApiError(Exception):
    """An HTTP error with an OpenAI-style body; `code` is the stable machine-readable reason."""

    def __init__(self, status: int, message: str, *, code: str | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param

    def body(self) -> dict[str, object]:
        return {"error": {"message": self.message, "type": error_type(self.status), "param": self.param,
                          "code": self.code}}

    def response(self) -> web.Response:
        return web.json_response(self.body(), status=self.status)


def bad_request(message: str, param: str | None = None, code: str = "invalid_value") -> ApiError:
    return ApiError(400, message, code=code, param=param)


def model_not_found(model: str) -> ApiError:
    return ApiError(404, f"The model `{model}` does not exist.", code="model_not_found", param="model")


def from_daemon(exc: LoraplexError, model: str | None = None) -> ApiError:
    """The HTTP error for a daemon (or client library) failure; `model` names
    the requested model for an unknown adapter."""
    if exc.code is ErrorCode.UNKNOWN_ADAPTER and model is not None:
        return model_not_found(model)
    status, code = _DAEMON_STATUS.get(exc.code, (500, exc.code.value))
    param = "prompt" if exc.code in (ErrorCode.PROMPT_TOO_LONG, ErrorCode.INVALID_TOKEN) \
        else "max_tokens" if exc.code is ErrorCode.CONTEXT_LENGTH_EXCEEDED else None
    return ApiError(status, exc.message, code=code, param=param)


# Request fields of the daemon's generate message -> the OpenAI parameter they come from.
_PARAM_OF_FIELD = {"prompt_token_ids": "prompt", "adapter": "model", "stop_token_ids": "stop_token_ids",
                   "top_k (-1 disables)": "top_k"}


def from_protocol(exc: ProtocolError) -> ApiError:
    """A 400 for a request the client library refused to build (a field out of the daemon's range)."""
    field = exc.message.split(":", 1)[0].split("[", 1)[0].strip()
    param = _PARAM_OF_FIELD.get(field, field if field.isidentifier() else None)
    return bad_request(exc.message, param=param)
