"""Requests a client sends to the daemon's client socket.

Owns the declarations and range rules of generate, cancel, adapters, stats
and ping. Sampling defaults follow vLLM's SamplingParams so users get the
behaviour they expect. Never holds serving logic (vocabulary size, context
length, adapter existence are the daemon's checks, not the protocol's).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from loraplex.ipc.messages.base import Message, register
from loraplex.ipc.messages.checks import (
    INT32_MAX,
    INT32_MIN,
    UINT63_MAX,
    check_float,
    check_int,
    check_len,
    check_name,
    check_optional_request_id,
    check_request_id,
    check_token_ids,
    invalid,
)

MAX_PROMPT_TOKEN_IDS = 1 << 20
MAX_NEW_TOKENS = 1_000_000
MAX_TEMPERATURE = 100.0
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_LEN = 256
MAX_STOP_TOKEN_IDS = 256
MAX_SLO_TTFT_MS = 3_600_000.0
MAX_DEADLINE_MS = 86_400_000.0


@register
@dataclass(frozen=True, slots=True)
class GenerateRequest(Message):
    """Generate a completion. Exactly one of `prompt` and `prompt_token_ids`.

    adapter: registered adapter name, or None for the base model.
    max_tokens: new tokens at most; None fills what the context leaves after the
    prompt (vLLM's behaviour when it is omitted). The daemon refuses a prompt plus
    max_tokens longer than the context (`context_length_exceeded`), never cuts it.
    top_k: -1 disables it. seed: None draws from the daemon's generator.
    priority: lower values are served earlier (vLLM's convention).
    slo_ttft_ms: the time-to-first-token target admission control may use.
    deadline_ms: give up (code `timeout`) this long after the daemon received
    the request.
    """

    TYPE = "generate"

    request_id: str
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    adapter: str | None = None
    max_tokens: int | None = 64
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    stream: bool = False
    logprobs: bool = False
    priority: int = 0
    slo_ttft_ms: float | None = None
    deadline_ms: float | None = None

    def validate(self) -> None:
        check_request_id("request_id", self.request_id)
        if (self.prompt is None) == (self.prompt_token_ids is None):
            raise invalid("exactly one of prompt and prompt_token_ids must be given")
        if self.prompt_token_ids is not None:
            check_token_ids("prompt_token_ids", self.prompt_token_ids, min_len=1, max_len=MAX_PROMPT_TOKEN_IDS)
        if self.adapter is not None:
            check_name("adapter", self.adapter)
        if self.max_tokens is not None:
            check_int("max_tokens", self.max_tokens, 1, MAX_NEW_TOKENS)
        check_float("temperature", self.temperature, 0.0, MAX_TEMPERATURE)
        check_float("top_p", self.top_p, 0.0, 1.0, lo_open=True)
        if self.top_k != -1:
            check_int("top_k (-1 disables)", self.top_k, 1, INT32_MAX)
        if self.seed is not None:
            check_int("seed", self.seed, 0, UINT63_MAX)
        check_len("stop", self.stop, 0, MAX_STOP_STRINGS)
        for i, s in enumerate(self.stop):
            check_len(f"stop[{i}]", s, 1, MAX_STOP_STRING_LEN)
        check_token_ids("stop_token_ids", self.stop_token_ids, max_len=MAX_STOP_TOKEN_IDS)
        check_int("priority", self.priority, INT32_MIN, INT32_MAX)
        if self.slo_ttft_ms is not None:
            check_float("slo_ttft_ms", self.slo_ttft_ms, 0.0, MAX_SLO_TTFT_MS, lo_open=True)
        if self.deadline_ms is not None:
            check_float("deadline_ms", self.deadline_ms, 0.0, MAX_DEADLINE_MS, lo_open=True)


@register
@dataclass(frozen=True, slots=True)
class CancelRequest(Message):
    """Cancel an in-flight generate of this client; answered by its `done`
    with finish_reason "cancelled", or an `error` with code not_found."""

    TYPE = "cancel"

    request_id: str

    def validate(self) -> None:
        check_request_id("request_id", self.request_id)


@register
@dataclass(frozen=True, slots=True)
class ListAdaptersRequest(Message):
    """List registered adapters. `request_id`, if given, is echoed in the reply
    (every non-generate request carries one so concurrent replies can be
    matched, and errors name what failed)."""

    TYPE = "adapters"

    request_id: str | None = None

    def validate(self) -> None:
        check_optional_request_id(self.request_id)


@register
@dataclass(frozen=True, slots=True)
class StatsRequest(Message):
    """One snapshot of the daemon's metrics, answered by `stats`."""

    TYPE = "stats"

    request_id: str | None = None

    def validate(self) -> None:
        check_optional_request_id(self.request_id)


@register
@dataclass(frozen=True, slots=True)
class PingRequest(Message):
    """Liveness probe, answered by `pong`."""

    TYPE = "ping"

    request_id: str | None = None

    def validate(self) -> None:
        check_optional_request_id(self.request_id)

