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

from loraplex.ipc.client import TopLogprobs

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
    tops: list[TopLogprobs | None] = field(default_factory=list)  # each token's alternatives, when asked
    ids: list[int | None] = field(default_factory=list)

    def extend(self, text: str, num_tokens: int, logprobs: list[float] | None,
               tops: list[TopLogprobs] | None = None, token_ids: list[int] | None = None) -> None:
        """Add one streamed chunk: `text` goes to its first token; a chunk
        without tokens (text the detokenizer held back) goes to the last one."""
        if num_tokens == 0:
            if self.texts:
                self.texts[-1] += text
            return
        self.texts.extend([text] + [""] * (num_tokens - 1))
        given: list[float | None] = list(logprobs or [])[:num_tokens]
        self.logprobs.extend(given + [None] * (num_tokens - len(given)))
        alternatives: list[TopLogprobs | None] = list(tops or [])[:num_tokens]
        self.tops.extend(alternatives + [None] * (num_tokens - len(alternatives)))
        ids: list[int | None] = list(token_ids or [])[:num_tokens]
        self.ids.extend(ids + [None] * (num_tokens - len(ids)))


def token_label(text: str, token_id: int | None, as_ids: bool) -> str:
    """How a token is spelled in logprobs: its text, or with vLLM's return_tokens_as_token_ids
    "token_id:N", which names the token exactly where its text alone cannot (a lone byte of a
    multi-byte character, tokens that decode alike). A token the daemon sent no id for keeps its text."""
    return f"token_id:{token_id}" if as_ids and token_id is not None else text


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

    def __init__(self, tokens_as_ids: bool = False) -> None:
        self.tokens_as_ids = tokens_as_ids  # return_tokens_as_token_ids: see token_label

    def choice(self, index: int, text: str, reason: str, tokens: Tokens | None) -> dict[str, object]:
        return {"index": index, "text": text, "logprobs": _completion_logprobs(tokens, 0, self.tokens_as_ids),
                "finish_reason": finish_reason(reason)}

    def opening(self, index: int) -> dict[str, object] | None:
        return None

    def delta(self, index: int, text: str, tokens: Tokens | None, offset: int) -> dict[str, object]:
        return {"index": index, "text": text, "logprobs": _completion_logprobs(tokens, offset, self.tokens_as_ids),
                "finish_reason": None}

    def closing(self, index: int, reason: str) -> dict[str, object]:
        return {"index": index, "text": "", "logprobs": None, "finish_reason": finish_reason(reason)}


class ChatFormat:
    object = "chat.completion"
    chunk_object = "chat.completion.chunk"
    id_prefix = "chatcmpl-"

    def __init__(self, tokens_as_ids: bool = False) -> None:
        self.tokens_as_ids = tokens_as_ids  # return_tokens_as_token_ids: see token_label

    def choice(self, index: int, text: str, reason: str, tokens: Tokens | None) -> dict[str, object]:
        return {"index": index, "message": {"role": "assistant", "content": text},
                "logprobs": _chat_logprobs(tokens, self.tokens_as_ids), "finish_reason": finish_reason(reason)}

    def opening(self, index: int) -> dict[str, object] | None:
        return {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                "finish_reason": None}

    def delta(self, index: int, text: str, tokens: Tokens | None, offset: int) -> dict[str, object]:
        return {"index": index, "delta": {"content": text}, "logprobs": _chat_logprobs(tokens, self.tokens_as_ids),
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

    def body(self, choices: list[dict[str, object]], usage_: dict[str, object]) -> dict[str, object]:
        return {"id": self.id, "object": self.fmt.object, "created": self.created, "model": self.model,
                "choices": choices, "usage": usage_, "system_fingerprint": None}

    def chunk(self, choices: list[dict[str, object]], usage_: dict[str, object] | None = None,
              with_usage_key: bool = False) -> dict[str, object]:
        chunk: dict[str, object] = {"id": self.id, "object": self.fmt.chunk_object, "created": self.created,
                                    "model": self.model, "choices": choices}
        if with_usage_key or usage_ is not None:
            chunk["usage"] = usage_
        return chunk


def _completion_logprobs(tokens: Tokens | None, offset: int, as_ids: bool = False) -> dict[str, object] | None:
    """The legacy completions shape; each top_logprobs map holds the alternatives (each token
    decoded alone, so texts that decode alike share a key), and the sampled token under its
    text in the completion when it is not among them (up to logprobs + 1 entries, as vLLM)."""
    if tokens is None:
        return None
    offsets = []
    for text in tokens.texts:
        offsets.append(offset)
        offset += len(text)
    tops = []
    labels = [token_label(text, token, as_ids) for text, token in zip(tokens.texts, tokens.ids, strict=True)]
    for label, lp, top, token in zip(labels, tokens.logprobs, tokens.tops, tokens.ids, strict=True):
        if top is None:
            tops.append({label: lp})
            continue
        entry: dict[str, float | None] = {}
        for t, alt_id, alt in zip(top.texts, top.token_ids, top.logprobs):
            entry.setdefault(token_label(t, alt_id, as_ids), alt)
        if token not in top.token_ids:
            entry.setdefault(label, lp)
        tops.append(entry)
    return {"tokens": labels, "token_logprobs": list(tokens.logprobs), "top_logprobs": tops,
            "text_offset": offsets}


def _chat_logprobs(tokens: Tokens | None, as_ids: bool = False) -> dict[str, object] | None:
    """`bytes` are always the token's text (its UTF-8), whatever `token` is spelled as."""
    if tokens is None:
        return None
    return {"content": [{"token": token_label(t, token, as_ids), "logprob": lp, "bytes": list(t.encode("utf-8")),
                         "top_logprobs": _chat_alternatives(top, as_ids)}
                        for t, token, lp, top in zip(tokens.texts, tokens.ids, tokens.logprobs, tokens.tops,
                                                     strict=True)]}


def _chat_alternatives(top: TopLogprobs | None, as_ids: bool) -> list[dict[str, object]]:
    if top is None:
        return []
    return [{"token": token_label(t, token, as_ids), "logprob": lp, "bytes": list(t.encode("utf-8"))}
            for t, token, lp in zip(top.texts, top.token_ids, top.logprobs)]
