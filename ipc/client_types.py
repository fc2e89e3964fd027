"""The values the client library hands its callers: stream chunks, finished results,
adapter entries, the liveness settings, and fresh request ids.

Plain frozen dataclasses, no I/O. Never imports torch or numpy.
"""
from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any, Mapping

from loraplex.ipc.protocol import PromptLogprobs, TopLogprobs

REQUEST_ID_PREFIX = "lpx-"
PROBE_ID_PREFIX = "lpx-probe-"


def new_request_id(prefix: str = REQUEST_ID_PREFIX) -> str:
    """A fresh client-side request id: prefix + uuid4 hex (unique without coordination)."""
    return f"{prefix}{uuid.uuid4().hex}"


@dataclass(frozen=True, slots=True)
class StreamChunk:
    """Tokens of one `token` reply. `index` is the completion position of the
    first token; `logprobs` has one entry per token id when requested, and so
    has `top_logprobs` (the most likely alternatives) when requested."""

    request_id: str
    token_ids: list[int]
    text: str
    index: int
    logprobs: list[float] | None = None
    top_logprobs: list[TopLogprobs] | None = None
    choice: int = 0  # which of the request's n completions


@dataclass(frozen=True, slots=True)
class Tokenized:
    """A text's token ids under the daemon's tokenizer, and the context it serves."""

    token_ids: list[int]
    max_model_len: int


@dataclass(frozen=True, slots=True)
class Choice:
    """One of the n completions of a generate; logprobs/top_logprobs as in GenerateResult."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str
    logprobs: list[float] | None = None
    top_logprobs: list[TopLogprobs] | None = None


@dataclass(frozen=True, slots=True)
class GenerateResult:
    """A finished generate, from the daemon's `done` reply.

    finish_reason: "stop", "length", "cancelled" (after `cancel`) or "error".
    usage: prompt_tokens, completion_tokens (and whatever else the daemon counts).
    timings: milliseconds queue_ms, e2e_ms (always), ttft_ms, tpt_ms (once a
    token was produced) and adapter_path ("base", "cached", "loaded" or
    "cpu_assisted"). logprobs: one per completion token when requested, else None;
    top_logprobs: likewise, each the alternatives at that position. choices: every
    completion when n > 1 (text, token_ids, finish_reason and the logprobs above are
    choice 0's; usage counts all of them); the one choice otherwise. prompt_logprobs: when
    asked (`prompt_logprobs=k`), each prompt token's logprob given the tokens before it (None
    for the first), its rank and k alternatives (ipc.protocol.PromptLogprobs).
    """

    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str
    usage: dict[str, int]
    timings: dict[str, float | str]
    logprobs: list[float] | None = None
    top_logprobs: list[TopLogprobs] | None = None
    choices: list[Choice] = field(default_factory=list)
    prompt_logprobs: PromptLogprobs | None = None


@dataclass(frozen=True, slots=True)
class AdapterInfo:
    """One registered adapter; `extra` holds the daemon's informational keys
    (pinned, hits, resident pages...)."""

    name: str
    path: str
    rank: int
    target_modules: tuple[str, ...]
    state: str
    extra: Mapping[str, object] = field(default_factory=dict)

    @classmethod
    def from_entry(cls, entry: Mapping[str, Any]) -> AdapterInfo:
        known = ("name", "path", "rank", "target_modules", "state")
        return cls(
            name=entry["name"],
            path=entry["path"],
            rank=entry["rank"],
            target_modules=tuple(entry["target_modules"]),
            state=entry["state"],
            extra={k: v for k, v in entry.items() if k not in known},
        )


@dataclass(frozen=True, slots=True)
class Liveness:
    """When a client suspects a silent daemon, while requests are in flight.

    After `probe_after_s` without any message from the daemon the client sends
    a ping; if nothing at all arrives within `probe_timeout_s` after it, every
    in-flight request fails with code `unavailable`. (A closed connection,
    e.g. the daemon process died, fails them at once without waiting.)
    """

    probe_after_s: float = 5.0
    probe_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        for name in ("probe_after_s", "probe_timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 86_400:
                raise ValueError(f"Liveness.{name} must be in (0, 86400] seconds, got {value!r}")

    def describe(self) -> str:
        return f"no message for {self.probe_after_s:g} s and no answer to a ping within {self.probe_timeout_s:g} s"
