"""Replies the daemon sends on the client socket (and, for stats, on PUB).

Owns token/done/tokenized/detokenized/error/adapter_list/stats_snapshot/pong and their rules,
plus the conversions between error replies and exceptions. Never decides
what a reply should say; the daemon does.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Literal

from loraplex.ipc.engine_plan import MAX_TOP_LOGPROBS
from loraplex.ipc.errors import ErrorCode, LoraplexError, ProtocolError
from loraplex.ipc.messages.base import Message, register
from loraplex.ipc.messages.checks import (
    MAX_PATH_LEN,
    AtLeast,
    Length,
    NameRule,
    OneOf,
    RequestId,
    TokenIds,
    invalid,
    is_valid_request_id,
)
from loraplex.ipc.messages.fields import Rule

MAX_COMPLETION_TOKEN_IDS = 1 << 20
MAX_TOKEN_TEXT_LEN = 1024  # one token decoded alone
MAX_ERROR_MESSAGE_LEN = 4096
# How the adapter reached the GPU for this request (README, "Adapter load modes").
ADAPTER_PATHS = ("base", "cached", "loaded", "cpu_assisted", "merged")
FINISH_REASONS = ("stop", "length", "cancelled", "error")
# Timings present in every `done`; TTFT and time per token only exist once a
# token was produced, so they are required only then.
ALWAYS_TIMINGS = ("queue_ms", "e2e_ms")
TOKEN_TIMINGS = ("ttft_ms", "tpt_ms")

FinishReason = Literal["stop", "length", "cancelled", "error"]


@dataclass(frozen=True, slots=True)
class TopLogprobs:
    """The most likely tokens at one position of a completion, most likely first, with
    their logprobs under the model's raw distribution; `texts`: each token decoded alone
    (empty strings when the model has no tokenizer)."""

    token_ids: Annotated[list[int], TokenIds(0, MAX_TOP_LOGPROBS)]
    logprobs: Annotated[list[float], Length(0, MAX_TOP_LOGPROBS)]
    texts: Annotated[list[Annotated[str, Length(0, MAX_TOKEN_TEXT_LEN)]], Length(0, MAX_TOP_LOGPROBS)]

    def __post_init__(self) -> None:
        if not len(self.token_ids) == len(self.logprobs) == len(self.texts):
            raise ValueError("token_ids, logprobs and texts must have the same length")


@dataclass(frozen=True, slots=True)
class PromptLogprobs:
    """Each prompt token's logprob given the tokens before it (vLLM's prompt_logprobs), under
    the model's raw distribution: `logprobs[0]` and `ranks[0]` are None (the first token has no
    prefix); `ranks[i]`: 1 for the most likely token; `texts[i]`: the text token i adds after the
    ones before it (the texts join into the prompt's text, as the daemon decodes it); `top[i]`:
    the k most likely alternatives at position i (empty for token 0), when k > 0 was asked."""

    token_ids: Annotated[list[int], TokenIds(0, MAX_COMPLETION_TOKEN_IDS)]
    texts: Annotated[list[Annotated[str, Length(0, MAX_TOKEN_TEXT_LEN)]], Length(0, MAX_COMPLETION_TOKEN_IDS)]
    logprobs: Annotated[list[float | None], Length(0, MAX_COMPLETION_TOKEN_IDS)]
    ranks: Annotated[list[Annotated[int, AtLeast(1)] | None], Length(0, MAX_COMPLETION_TOKEN_IDS)]
    top: list[TopLogprobs] | None = None

    def __post_init__(self) -> None:
        n = len(self.token_ids)
        if not len(self.texts) == len(self.logprobs) == len(self.ranks) == n:
            raise ValueError("token_ids, texts, logprobs and ranks must have the same length")
        if self.top is not None and len(self.top) != n:
            raise ValueError(f"top: {len(self.top)} entries for {n} prompt tokens")


@register
@dataclass(frozen=True, slots=True)
class TokenChunk(Message):
    """Streamed tokens of one request. `index` is the position in the
    completion of this chunk's first token, so gaps are detectable.
    `logprobs`, when requested, has one entry per token id, and so has
    `top_logprobs` when alternatives were requested."""

    TYPE = "token"

    request_id: RequestId
    token_ids: Annotated[list[int], TokenIds(0, MAX_COMPLETION_TOKEN_IDS)]
    text: str = ""
    logprobs: list[float] | None = None
    index: Annotated[int, AtLeast(0)] = 0
    top_logprobs: list[TopLogprobs] | None = None
    choice: Annotated[int, AtLeast(0)] = 0  # which of the request's n completions

    def validate(self) -> None:
        if self.logprobs is not None and len(self.logprobs) != len(self.token_ids):
            raise invalid(f"logprobs: {len(self.logprobs)} entries for {len(self.token_ids)} token ids")
        if self.top_logprobs is not None and len(self.top_logprobs) != len(self.token_ids):
            raise invalid(f"top_logprobs: {len(self.top_logprobs)} entries for {len(self.token_ids)} token ids")


@dataclass(frozen=True, slots=True)
class ChoiceOutcome:
    """How one of a request's n completions ended."""

    index: Annotated[int, AtLeast(0)]
    finish_reason: FinishReason
    token_ids: Annotated[list[int], TokenIds(0, MAX_COMPLETION_TOKEN_IDS)]
    text: str


@register
@dataclass(frozen=True, slots=True)
class DoneReply(Message):
    """The last reply of every generate that was accepted.

    token_ids/text: the whole completion (also when it was streamed).
    usage: at least prompt_tokens and completion_tokens (ints >= 0).
    timings: at least queue_ms, e2e_ms and adapter_path (one of
    ADAPTER_PATHS); ttft_ms and tpt_ms too once a token was produced. Numeric
    timings are milliseconds >= 0; extra keys are allowed.
    choices: with n > 1, every completion in index order (the top-level
    finish_reason, token_ids and text are choice 0's; usage counts them all).
    prompt_logprobs: when the request asked for them (and its prompt was computed).
    """

    TYPE = "done"

    request_id: RequestId
    finish_reason: FinishReason
    usage: dict[str, Annotated[int, AtLeast(0)]]
    timings: dict[str, float | str]
    token_ids: Annotated[list[int], TokenIds(0, MAX_COMPLETION_TOKEN_IDS)] = field(default_factory=list)
    text: str = ""
    choices: list[ChoiceOutcome] | None = None
    prompt_logprobs: PromptLogprobs | None = None

    def validate(self) -> None:
        if self.choices is not None and [c.index for c in self.choices] != list(range(len(self.choices))):
            raise invalid("choices: indices must be 0..n-1 in order")
        for key in ("prompt_tokens", "completion_tokens"):
            if key not in self.usage:
                raise invalid(f"usage: missing {key!r}")
        required = ALWAYS_TIMINGS + (TOKEN_TIMINGS if self.usage["completion_tokens"] > 0 else ())
        for key in required + ("adapter_path",):
            if key not in self.timings:
                raise invalid(f"timings: missing {key!r}")
        for key, value in self.timings.items():
            if key == "adapter_path":
                if value not in ADAPTER_PATHS:
                    raise invalid(f"timings.adapter_path: must be one of {ADAPTER_PATHS}, got {value!r}")
            elif isinstance(value, float) and value < 0:
                raise invalid(f"timings.{key}: must be >= 0, got {value}")
            elif key in required and not isinstance(value, float):
                raise invalid(f"timings.{key}: must be a number of milliseconds, got {value!r}")


@register
@dataclass(frozen=True, slots=True)
class TokenizedReply(Message):
    """The answer to `tokenize`; max_model_len: the context the daemon serves."""

    TYPE = "tokenized"

    request_id: RequestId
    token_ids: Annotated[list[int], TokenIds(0, MAX_COMPLETION_TOKEN_IDS)]
    max_model_len: Annotated[int, AtLeast(0)] = 0


@register
@dataclass(frozen=True, slots=True)
class DetokenizedReply(Message):
    """The answer to `detokenize`."""

    TYPE = "detokenized"

    request_id: RequestId
    text: str


@register
@dataclass(frozen=True, slots=True)
class ErrorReply(Message):
    """A request failed. `code` is an ErrorCode value; `request_id` names the
    request when it could be read (None for undecodable frames)."""

    TYPE = "error"

    request_id: RequestId | None
    code: Annotated[str, OneOf(frozenset(code.value for code in ErrorCode), "error code")]
    message: Annotated[str, Length(0, MAX_ERROR_MESSAGE_LEN)]

    @property
    def error_code(self) -> ErrorCode:
        return ErrorCode(self.code)

    @classmethod
    def from_error(cls, error: ProtocolError | LoraplexError, request_id: str | None = None) -> ErrorReply:
        """The reply for an exception; long messages are cut to fit, and a
        request id that is not itself valid is dropped rather than failing."""
        rid = request_id if request_id is not None else error.request_id
        return cls(request_id=rid if is_valid_request_id(rid) else None, code=error.code.value,
                   message=error.message[:MAX_ERROR_MESSAGE_LEN])

    def to_exception(self) -> LoraplexError:
        """What the client library raises for this reply."""
        return LoraplexError(self.error_code, self.message, self.request_id)


class AdapterEntry(Rule):
    """One entry of an adapter list: an open map whose known keys have fixed types."""

    __slots__ = ()

    def __call__(self, entry: dict[str, object], where: str) -> None:
        name, path, rank = entry.get("name"), entry.get("path"), entry.get("rank")
        modules, state = entry.get("target_modules"), entry.get("state")
        if not isinstance(name, str):
            raise invalid(f"{where}.name: expected str, got {type(name).__name__}")
        NameRule()(name, f"{where}.name")
        if not isinstance(path, str) or not 1 <= len(path) <= MAX_PATH_LEN:
            raise invalid(f"{where}.path: expected a str of 1..{MAX_PATH_LEN} chars")
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
            raise invalid(f"{where}.rank: expected an int >= 0 (0: not loaded), got {rank!r}")
        if not isinstance(modules, list) or not all(isinstance(m, str) for m in modules):
            raise invalid(f"{where}.target_modules: expected a list of str")
        if not isinstance(state, str) or not 1 <= len(state) <= 64:
            raise invalid(f"{where}.state: expected a str of 1..64 chars")


@register
@dataclass(frozen=True, slots=True)
class AdaptersReply(Message):
    """Registered adapters. Each entry has at least name, path, rank (>= 0; 0 when unknown),
    target_modules (list of str) and state (non-empty str); extra keys are
    informational (pinned, hits, resident pages...)."""

    TYPE = "adapter_list"

    adapters: list[Annotated[dict[str, object], AdapterEntry()]]
    request_id: RequestId | None = None


@register
@dataclass(frozen=True, slots=True)
class StatsReply(Message):
    """A metrics snapshot: free-form map of plain values (finite floats only).
    Answers `stats` on the client socket and is what the stats PUB streams."""

    TYPE = "stats_snapshot"

    stats: dict[str, object]
    request_id: RequestId | None = None


@register
@dataclass(frozen=True, slots=True)
class PongReply(Message):
    """Answer to `ping`."""

    TYPE = "pong"

    request_id: RequestId | None = None
