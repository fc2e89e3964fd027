"""Every call of the client library, defined once: the request it sends, the reply it
expects, what its caller gets back, and its checks and default timeout.

The sync and async front ends (client_sync, client_async) build a Call here and only
carry it over their socket; a generate is `generate_request` plus a StreamAssembler
that turns its replies into chunks and a result. No I/O. Never imports torch or numpy.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any, Callable, Generic, Mapping, Sequence, TypedDict, TypeVar, Union

from loraplex.ipc.client_types import AdapterInfo, Choice, GenerateResult, StreamChunk, Tokenized, new_request_id
from loraplex.ipc.errors import ErrorCode, LoraplexError
from loraplex.ipc.guided import Guided
from loraplex.ipc.protocol import (
    MAX_DEADLINE_MS,
    AdaptersReply,
    AddAdapterRequest,
    AdminOkReply,
    DetokenizedReply,
    DetokenizeRequest,
    DoneReply,
    DrainRequest,
    ErrorReply,
    GenerateRequest,
    ListAdaptersRequest,
    Message,
    PauseRequest,
    PinAdapterRequest,
    PingRequest,
    PolicyKind,
    PongReply,
    RemoveAdapterRequest,
    SetPolicyRequest,
    StatsReply,
    StatsRequest,
    TokenChunk,
    TokenizedReply,
    TokenizeRequest,
    TopLogprobs,
)

CONTROL_TIMEOUT_S = 10.0
ADD_ADAPTER_TIMEOUT_S = 120.0  # an add hashes and validates the adapter's files first

# What a waiting caller receives: a reply for its request id, or a local failure.
Item = Union[Message, LoraplexError]
M = TypeVar("M", bound=Message)
R = TypeVar("R")


def check_timeout(timeout: float | None) -> float | None:
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0):
        raise ValueError(f"timeout must be a positive number of seconds or None, got {timeout!r}")
    return None if timeout is None else float(timeout)


def expect(item: Item, cls: type[M], request_id: str) -> M:
    """`item` if it is the `cls` reply; raise the daemon's error or a local one otherwise."""
    if isinstance(item, LoraplexError):
        raise item
    if isinstance(item, ErrorReply):
        raise item.to_exception()
    if not isinstance(item, cls):
        raise LoraplexError(ErrorCode.BAD_MESSAGE, f"expected a {cls.TYPE} reply, got {item.TYPE}", request_id)
    return item


@dataclass(frozen=True, slots=True)
class Call(Generic[R]):
    """One request and the one reply that answers it. `request` carries a fresh request id;
    `answer` turns the expected reply into what the caller gets back."""

    request: Message
    reply: type[Message]
    answer: Callable[[Any], R]
    timeout: float | None

    def __post_init__(self) -> None:
        object.__setattr__(self, "timeout", check_timeout(self.timeout))

    @property
    def request_id(self) -> str:
        return self.request.request_id  # type: ignore[attr-defined]

    def finish(self, item: Item) -> R:
        """What the caller gets for `item`; raises LoraplexError for an error reply or a local failure."""
        return self.answer(expect(item, self.reply, self.request_id))


def _admin(request: Message, timeout: float | None) -> Call[dict[str, object]]:
    """An admin order: answered by `admin_ok`, whose `detail` map the caller gets."""
    return Call(request, AdminOkReply, lambda reply: dict(reply.detail), timeout)


def list_adapters(timeout: float | None) -> Call[list[AdapterInfo]]:
    return Call(ListAdaptersRequest(request_id=new_request_id()), AdaptersReply,
                lambda reply: [AdapterInfo.from_entry(entry) for entry in reply.adapters], timeout)


def tokenize(text: str, timeout: float | None) -> Call[Tokenized]:
    return Call(TokenizeRequest(request_id=new_request_id(), prompt=text), TokenizedReply,
                lambda reply: Tokenized(list(reply.token_ids), reply.max_model_len), timeout)


def detokenize(token_ids: Sequence[int], timeout: float | None) -> Call[str]:
    return Call(DetokenizeRequest(request_id=new_request_id(), token_ids=list(token_ids)), DetokenizedReply,
                lambda reply: reply.text, timeout)


def stats(timeout: float | None) -> Call[dict[str, object]]:
    return Call(StatsRequest(request_id=new_request_id()), StatsReply, lambda reply: dict(reply.stats), timeout)


def ping(timeout: float | None) -> Call[float]:
    """Answers the round-trip time in seconds, counted from now (just before the send)."""
    started = time.monotonic()
    return Call(PingRequest(request_id=new_request_id()), PongReply, lambda _: time.monotonic() - started, timeout)


def add_adapter(name: str, path: str | os.PathLike[str], replace: bool,
                timeout: float | None) -> Call[dict[str, object]]:
    return _admin(AddAdapterRequest(name=name, path=os.fspath(path), replace=replace, request_id=new_request_id()),
                  timeout)


def remove_adapter(name: str, timeout: float | None) -> Call[dict[str, object]]:
    return _admin(RemoveAdapterRequest(name=name, request_id=new_request_id()), timeout)


def pin_adapter(name: str, pinned: bool, timeout: float | None) -> Call[dict[str, object]]:
    return _admin(PinAdapterRequest(name=name, pinned=pinned, request_id=new_request_id()), timeout)


def drain(timeout_s: float) -> Call[dict[str, object]]:
    """The daemon answers once drained or after `timeout_s`: wait that long and the usual margin."""
    return _admin(DrainRequest(timeout_s=timeout_s, request_id=new_request_id()), timeout_s + CONTROL_TIMEOUT_S)


def set_policy(kind: PolicyKind, name: str, timeout: float | None) -> Call[dict[str, object]]:
    return _admin(SetPolicyRequest(kind=kind, name=name, request_id=new_request_id()), timeout)


def pause(paused: bool, timeout: float | None) -> Call[dict[str, object]]:
    return _admin(PauseRequest(paused=paused, request_id=new_request_id()), timeout)


class GenerateOptions(TypedDict, total=False):
    """The keyword arguments of every client's generate() and stream(), declared once (their
    defaults are generate_request's). See Client.generate for what each means."""

    max_tokens: int | None
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop: str | Sequence[str] | None
    stop_token_ids: Sequence[int] | None
    ignore_eos: bool
    logprobs: bool
    top_logprobs: int
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    logit_bias: Mapping[int, float] | None
    min_tokens: int
    n: int
    guided: Guided | None
    prompt_logprobs: int | None
    priority: int
    slo_ttft_ms: float | None
    timeout: float | None
    request_id: str | None


GENERATE_OPTIONS = frozenset(GenerateOptions.__annotations__)


def generate_request(
    prompt: str | Sequence[int],
    *,
    adapter: str | None = None,
    stream: bool = False,
    request_id: str | None = None,
    max_tokens: int | None = 64,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = -1,
    seed: int | None = None,
    stop: str | Sequence[str] | None = None,
    stop_token_ids: Sequence[int] | None = None,
    ignore_eos: bool = False,
    logprobs: bool = False,
    priority: int = 0,
    slo_ttft_ms: float | None = None,
    timeout: float | None = None,
    top_logprobs: int = 0,
    presence_penalty: float = 0.0,
    frequency_penalty: float = 0.0,
    repetition_penalty: float = 1.0,
    logit_bias: Mapping[int, float] | None = None,
    min_tokens: int = 0,
    n: int = 1,
    guided: Guided | None = None,
    prompt_logprobs: int | None = None,
) -> GenerateRequest:
    """The validated `generate` message for the client methods' arguments.

    Requests logprobs (and top_logprobs) as a stream even for a plain generate,
    because only `token` chunks carry them. logit_bias: token id -> bias. The timeout also becomes the daemon-side
    deadline, so a timed-out request is dropped there even if our cancel is lost.
    Raises ValueError (ProtocolError for fields) for out-of-range arguments.
    """
    timeout = check_timeout(timeout)
    if isinstance(prompt, str):
        text, ids = prompt, None
    elif isinstance(prompt, Sequence) and not isinstance(prompt, (bytes, bytearray)):
        text, ids = None, list(prompt)
    else:
        raise TypeError(f"prompt must be a str or a sequence of token ids, got {type(prompt).__name__}")
    deadline_ms = None if timeout is None or timeout * 1000.0 > MAX_DEADLINE_MS else timeout * 1000.0
    return GenerateRequest(
        request_id=request_id if request_id is not None else new_request_id(),
        prompt=text,
        prompt_token_ids=ids,
        adapter=adapter,
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        seed=seed,
        stop=[stop] if isinstance(stop, str) else list(stop or ()),
        stop_token_ids=list(stop_token_ids or ()),
        ignore_eos=ignore_eos,
        stream=stream or logprobs or top_logprobs > 0,
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        presence_penalty=presence_penalty,
        frequency_penalty=frequency_penalty,
        repetition_penalty=repetition_penalty,
        logit_bias=_bias_map(logit_bias),
        min_tokens=min_tokens,
        n=n,
        guided_kind=guided.kind if guided is not None else None,
        guided_spec=guided.spec if guided is not None else "",
        priority=priority,
        slo_ttft_ms=slo_ttft_ms,
        deadline_ms=deadline_ms,
        prompt_logprobs=prompt_logprobs,
    )


def _bias_map(logit_bias: Mapping[int, float] | Mapping[str, float] | None) -> dict[str, float]:
    """The wire's logit_bias: decimal token id strings (as OpenAI's JSON keys) -> bias; the
    message checks the ids and the biases."""
    if not logit_bias:
        return {}
    out = {}
    for token, bias in logit_bias.items():
        if isinstance(token, bool) or not isinstance(token, (int, str)):
            raise ValueError(f"logit_bias: keys must be token ids, got {token!r}")
        out[str(token)] = bias
    return out


class StreamAssembler:
    """Turns the replies of one generate into chunks, then one result."""

    def __init__(self, request: GenerateRequest) -> None:
        self.request_id = request.request_id
        self.result: GenerateResult | None = None
        want_logprobs = request.logprobs or request.top_logprobs > 0
        # Per choice, from the token chunks (the done reply carries neither).
        self._logprobs: list[list[float]] | None = [[] for _ in range(request.n)] if want_logprobs else None
        self._top: list[list[TopLogprobs]] | None = [[] for _ in range(request.n)] \
            if request.top_logprobs > 0 else None

    def _choice_logprobs(self, index: int) -> list[float] | None:
        return self._logprobs[index] if self._logprobs is not None and index < len(self._logprobs) else None

    def _choice_top(self, index: int) -> list[TopLogprobs] | None:
        return self._top[index] if self._top is not None and index < len(self._top) else None

    def finished_result(self) -> GenerateResult:
        if self.result is None:
            raise RuntimeError(f"request {self.request_id} has not finished; read its stream to the end first")
        return self.result

    def feed(self, item: Item) -> StreamChunk | None:
        """The chunk in `item`; None once `item` finished the request (see
        `.result`); raises LoraplexError for an error reply or local failure."""
        if isinstance(item, TokenChunk):
            if self._logprobs is not None and item.logprobs is not None and item.choice < len(self._logprobs):
                self._logprobs[item.choice].extend(item.logprobs)
            if self._top is not None and item.top_logprobs is not None and item.choice < len(self._top):
                self._top[item.choice].extend(item.top_logprobs)
            return StreamChunk(item.request_id, item.token_ids, item.text, item.index, item.logprobs,
                               item.top_logprobs, item.choice)
        done = expect(item, DoneReply, self.request_id)
        self.result = GenerateResult(
            request_id=done.request_id,
            text=done.text,
            token_ids=done.token_ids,
            finish_reason=done.finish_reason,
            usage=dict(done.usage),
            timings=dict(done.timings),
            logprobs=self._choice_logprobs(0),
            top_logprobs=self._choice_top(0),
            prompt_logprobs=done.prompt_logprobs,
            choices=[Choice(c.index, c.text, list(c.token_ids), c.finish_reason, self._choice_logprobs(c.index),
                            self._choice_top(c.index)) for c in done.choices]
            if done.choices is not None else
            [Choice(0, done.text, list(done.token_ids), done.finish_reason, self._choice_logprobs(0),
                    self._choice_top(0))],
        )
        return None
