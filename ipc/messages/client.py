"""Requests a client sends to the daemon's client socket.

Owns the declarations (each field with its rules) of generate, tokenize,
detokenize, cancel, adapters, stats and ping. Sampling defaults follow vLLM's SamplingParams so users get the
behaviour they expect. Never holds serving logic (vocabulary size, context
length, adapter existence are the daemon's checks, not the protocol's).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Literal

from loraplex.ipc.engine_plan import (
    MAX_GUIDED_SPEC,
    MAX_LOGIT_BIAS,
    MAX_LOGIT_BIAS_ENTRIES,
    MAX_PENALTY,
    MAX_REPETITION_PENALTY,
    MAX_TOP_LOGPROBS,
)
from loraplex.ipc.errors import ErrorCode
from loraplex.ipc.guided import GrammarTooComplex, check_guided
from loraplex.ipc.messages.base import Message, register
from loraplex.ipc.messages.checks import (
    INT32_MAX,
    INT32_MIN,
    MAX_TOKEN_ID,
    UINT63_MAX,
    InInterval,
    InRange,
    Length,
    Name,
    RequestId,
    TokenIds,
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
MAX_CHOICES = 128  # n, as OpenAI bounds it


@register
@dataclass(frozen=True, slots=True)
class GenerateRequest(Message):
    """Generate a completion. Exactly one of `prompt` and `prompt_token_ids`.

    adapter: registered adapter name, or None for the base model.
    max_tokens: new tokens at most; None fills what the context leaves after the
    prompt (vLLM's behaviour when it is omitted). The daemon refuses a prompt plus
    max_tokens longer than the context (`context_length_exceeded`), never cuts it.
    top_k: -1 disables it. seed: None draws from the daemon's generator.
    logprobs: the sampled token's logprob; top_logprobs (0..20) adds that many
    most likely alternatives per token (and implies logprobs).
    prompt_logprobs: None, or k in 0..20: the `done` reply carries each prompt token's logprob
    given the tokens before it (the first has none), its rank, and k alternatives (vLLM's
    prompt_logprobs); prompt tokens x (k + 1) is bounded (MAX_PROMPT_LOGPROB_ENTRIES).
    presence_penalty, frequency_penalty, repetition_penalty, logit_bias (token
    id as a decimal string -> bias) and min_tokens as vLLM's SamplingParams;
    ipc.engine_plan.SamplingSpec says how they act on the logits.
    n: completions of the one prompt (OpenAI's n): each streams its tokens with
    its `choice` index, and one `done` ends them all. With a seed, choice i
    samples with seed + i, so the choices differ and each is reproducible.
    guided_kind, guided_spec: structured output (ipc.guided.Guided); a grammar
    that does not compile fails the request (invalid_field, with why), one past the
    server's nesting, time or memory limits with grammar_too_complex.
    priority: lower values are served earlier (vLLM's convention).
    slo_ttft_ms: the time-to-first-token target admission control may use.
    deadline_ms: give up (code `timeout`) this long after the daemon received
    the request.
    """

    TYPE = "generate"

    request_id: RequestId
    prompt: str | None = None
    prompt_token_ids: Annotated[list[int], TokenIds(1, MAX_PROMPT_TOKEN_IDS)] | None = None
    adapter: Name | None = None
    max_tokens: Annotated[int, InRange(1, MAX_NEW_TOKENS)] | None = 64
    temperature: Annotated[float, InInterval(0.0, MAX_TEMPERATURE)] = 1.0
    top_p: Annotated[float, InInterval(0.0, 1.0, lo_open=True)] = 1.0
    top_k: Annotated[int, InRange(1, INT32_MAX, off=-1)] = -1
    seed: Annotated[int, InRange(0, UINT63_MAX)] | None = None
    stop: Annotated[list[Annotated[str, Length(1, MAX_STOP_STRING_LEN)]], Length(0, MAX_STOP_STRINGS)] = field(
        default_factory=list)
    stop_token_ids: Annotated[list[int], TokenIds(0, MAX_STOP_TOKEN_IDS)] = field(default_factory=list)
    ignore_eos: bool = False
    stream: bool = False
    logprobs: bool = False
    top_logprobs: Annotated[int, InRange(0, MAX_TOP_LOGPROBS)] = 0
    presence_penalty: Annotated[float, InInterval(-MAX_PENALTY, MAX_PENALTY)] = 0.0
    frequency_penalty: Annotated[float, InInterval(-MAX_PENALTY, MAX_PENALTY)] = 0.0
    repetition_penalty: Annotated[float, InInterval(0.0, MAX_REPETITION_PENALTY, lo_open=True)] = 1.0
    logit_bias: Annotated[dict[str, Annotated[float, InInterval(-MAX_LOGIT_BIAS, MAX_LOGIT_BIAS)]],
                          Length(0, MAX_LOGIT_BIAS_ENTRIES)] = field(default_factory=dict)
    min_tokens: Annotated[int, InRange(0, MAX_NEW_TOKENS)] = 0
    n: Annotated[int, InRange(1, MAX_CHOICES)] = 1
    guided_kind: Literal["json_schema", "json_object", "regex", "choice"] | None = None
    guided_spec: Annotated[str, Length(0, MAX_GUIDED_SPEC)] = ""
    priority: Annotated[int, InRange(INT32_MIN, INT32_MAX)] = 0
    slo_ttft_ms: Annotated[float, InInterval(0.0, MAX_SLO_TTFT_MS, lo_open=True)] | None = None
    deadline_ms: Annotated[float, InInterval(0.0, MAX_DEADLINE_MS, lo_open=True)] | None = None
    prompt_logprobs: Annotated[int, InRange(0, MAX_TOP_LOGPROBS)] | None = None

    def validate(self) -> None:
        if (self.prompt is None) == (self.prompt_token_ids is None):
            raise invalid("exactly one of prompt and prompt_token_ids must be given")
        for key in self.logit_bias:
            if not (len(key) <= 10 and key.isascii() and key.isdigit()) or int(key) > MAX_TOKEN_ID:
                raise invalid(f"logit_bias: key {key[:16]!r} is not a token id", ErrorCode.INVALID_TOKEN)
        if self.guided_kind is not None:
            try:
                check_guided(self.guided_kind, self.guided_spec)
            except GrammarTooComplex as exc:
                raise invalid(str(exc), ErrorCode.GRAMMAR_TOO_COMPLEX) from None
            except ValueError as exc:
                raise invalid(str(exc)) from None
        elif self.guided_spec:
            raise invalid("guided_spec without guided_kind")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise invalid(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")

    def bias_lists(self) -> tuple[list[int], list[float]]:
        """logit_bias as (token ids, biases)."""
        return [int(k) for k in self.logit_bias], list(self.logit_bias.values())


@register
@dataclass(frozen=True, slots=True)
class TokenizeRequest(Message):
    """The model's token ids for `prompt` (the tokenizer the daemon prompts with),
    answered by `tokenized`. The daemon bounds the text as it bounds prompts."""

    TYPE = "tokenize"

    request_id: RequestId
    prompt: str


@register
@dataclass(frozen=True, slots=True)
class DetokenizeRequest(Message):
    """The text of `token_ids` (special tokens kept), answered by `detokenized`."""

    TYPE = "detokenize"

    request_id: RequestId
    token_ids: Annotated[list[int], TokenIds(0, MAX_PROMPT_TOKEN_IDS)]


@register
@dataclass(frozen=True, slots=True)
class CancelRequest(Message):
    """Cancel an in-flight generate of this client; answered by its `done`
    with finish_reason "cancelled", or an `error` with code not_found."""

    TYPE = "cancel"

    request_id: RequestId


@register
@dataclass(frozen=True, slots=True)
class ListAdaptersRequest(Message):
    """List registered adapters. `request_id`, if given, is echoed in the reply
    (every non-generate request carries one so concurrent replies can be
    matched, and errors name what failed)."""

    TYPE = "adapters"

    request_id: RequestId | None = None


@register
@dataclass(frozen=True, slots=True)
class StatsRequest(Message):
    """One snapshot of the daemon's metrics, answered by `stats`."""

    TYPE = "stats"

    request_id: RequestId | None = None


@register
@dataclass(frozen=True, slots=True)
class PingRequest(Message):
    """Liveness probe, answered by `pong`."""

    TYPE = "ping"

    request_id: RequestId | None = None

