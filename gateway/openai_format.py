"""The JSON shapes of OpenAI responses: completion and chat bodies, their
streamed chunks, usage and logprobs.

Two formats (text completions, chat) with one interface, so the request
driver streams or collects without knowing which endpoint it serves. Pure
functions of their inputs; no I/O.
"""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Protocol

# The daemon's finish reasons -> OpenAI's ("cancelled" only reaches a client that went away).
_FINISH = {"stop": "stop", "length": "length", "cancelled": "abort"}


def finish_reason(daemon_reason: str) -> str:
    return _FINISH.get(daemon_reason, daemon_reason)


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, object]:
    """OpenAI's usage object; cached_tokens: prompt tokens whose KV the prefix cache held."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


@dataclass(slots=True)
class Tokens:
    """The completion tokens of one choice as text pieces (the text each token
    added; their concatenation is the choice's text) with their logprobs."""

    texts: list[str] = field(default_factory=list)
    logprobs: list[float | None] = field(default_factory=list)  # None (JSON null): the daemon sent none

    def extend(self, text: str, num_tokens: int, logprobs: list[float] | None) -> None:
        """Add one streamed chunk: `text` goes to its first token; a chunk
        without tokens (text the detokenizer held back) goes to the last one."""
        if num_tokens == 0:
            if self.texts:
                self.texts[-1] += text
            return
        self.texts.extend([text] + [""] * (num_tokens - 1))
        given: list[float | None] = list(logprobs or [])[:num_tokens]
        self.logprobs.extend(given + [None] * (num_tokens - len(given)))


class Format(Protocol):
    """How one endpoint spells its responses."""

    object: str
    chunk_object: str

    def choice(self, index: int, text: str, reason: str, tokens: Tokens | None) -> dict[str, object]: ...

    def opening(self, index: int) -> dict[str, object] | None: ...

    def delta(self, index: int, text: str, tokens: Tokens | None, offset: int) -> dict[str, object]: ...

    def closing(self, index: int, reason: str) -> dict[str, object]: ...


class CompletionFormat:
    object = "text_completion"
    chunk_object = "text_completion"
    id_prefix = "cmpl-"

    def choice(self, index: int, text: str, reason: str, tokens: Tokens | None) -> dict[str, object]:
        return {"index": index, "text": text, "logprobs": _completion_logprobs(tokens, 0),
                "finish_reason": finish_reason(reason)}

    def opening(self, index: int) -> dict[str, object] | None:
        return None

    def delta(self, index: int, text: str, tokens: Tokens | None, offset: int) -> dict[str, object]:
        return {"index": index, "text": text, "logprobs": _completion_logprobs(tokens, offset), "finish_reason": None}

    def closing(self, index: int, reason: str) -> dict[str, object]:
        return {"index": index, "text": "", "logprobs": None, "finish_reason": finish_reason(reason)}


class ChatFormat:
    object = "chat.completion"
    chunk_object = "chat.completion.chunk"
    id_prefix = "chatcmpl-"

    def choice(self, index: int, text: str, reason: str, tokens: Tokens | None) -> dict[str, object]:
        return {"index": index, "message": {"role": "assistant", "content": text},
                "logprobs": _chat_logprobs(tokens), "finish_reason": finish_reason(reason)}

    def opening(self, index: int) -> dict[str, object] | None:
        return {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                "finish_reason": None}

    def delta(self, index: int, text: str, tokens: Tokens | None, offset: int) -> dict[str, object]:
        return {"index": index, "delta": {"content": text}, "logprobs": _chat_logprobs(tokens),
                "finish_reason": None}

    def closing(self, index: int, reason: str) -> dict[str, object]:
        return {"index": index, "delta": {}, "logprobs": None, "finish_reason": finish_reason(reason)}


@dataclass(frozen=True, slots=True)
class Envelope:
    """What every body and chunk of one response repeats: id, created, model."""

    fmt: Format
    model: str
    id: str
    created: int

    @classmethod
    def new(cls, fmt: CompletionFormat | ChatFormat, model: str) -> Envelope:
        return cls(fmt, model, f"{fmt.id_prefix}{uuid.uuid4().hex}", int(time.time()))

    def body(self, choices: list[dict[str, object]], usage_: dict[str, int]) -> dict[str, object]:
        return {"id": self.id, "object": self.fmt.object, "created": self.created, "model": self.model,
                "choices": choices, "usage": usage_, "system_fingerprint": None}

    def chunk(self, choices: list[dict[str, object]], usage_: dict[str, int] | None = None,
              with_usage_key: bool = False) -> dict[str, object]:
        chunk: dict[str, object] = {"id": self.id, "object": self.fmt.chunk_object, "created": self.created,
                                    "model": self.model, "choices": choices}
        if with_usage_key or usage_ is not None:
            chunk["usage"] = usage_
        return chunk


def _completion_logprobs(tokens: Tokens | None, offset: int) -> dict[str, object] | None:
    """The legacy completions shape; top_logprobs holds just the sampled token (logprobs=0)."""
    if tokens is None:
        return None
    offsets = []
    for text in tokens.texts:
        offsets.append(offset)
        offset += len(text)
    pairs = list(zip(tokens.texts, tokens.logprobs, strict=True))
    return {"tokens": list(tokens.texts), "token_logprobs": list(tokens.logprobs),
            "top_logprobs": [{t: lp} for t, lp in pairs], "text_offset": offsets}


def _chat_logprobs(tokens: Tokens | None) -> dict[str, object] | None:
    if tokens is None:
        return None
    return {"content": [{"token": t, "logprob": lp, "bytes": list(t.encode("utf-8")), "top_logprobs": []}
                        for t, lp in zip(tokens.texts, tokens.logprobs, strict=True)]}
