"""Prompt logprobs in OpenAI and vLLM shapes: what a completions request asks of the prompt
(`echo` with `logprobs`, vLLM's `prompt_logprobs`, `max_tokens: 0`) and how the daemon's
PromptLogprobs read in a response (the echoed prompt's tokens before the completion's in
`logprobs`; vLLM's per-token `prompt_logprobs` maps).

Pure functions of their inputs; no I/O.
"""
from __future__ import annotations

from dataclasses import dataclass

from loraplex.gateway.openai_format import Tokens
from loraplex.ipc.client import PromptLogprobs, TopLogprobs


@dataclass(frozen=True, slots=True)
class PromptAsk:
    """What a completions request wants of its prompt. echo_logprobs: alternatives per echoed
    prompt token (echo with logprobs: the prompt's tokens lead `logprobs`), None when not
    echoed with logprobs; prompt_logprobs: vLLM's, None when not asked; generate: False for
    `max_tokens: 0` (the echo alone: one token is generated and dropped, as vLLM does)."""

    echo_logprobs: int | None = None
    prompt_logprobs: int | None = None
    generate: bool = True

    @property
    def alternatives(self) -> int | None:
        """What the daemon is asked for (prompt_logprobs=k), None when the prompt is not scored."""
        asked = [k for k in (self.echo_logprobs, self.prompt_logprobs) if k is not None]
        return max(asked) if asked else None


def echo_tokens(scored: PromptLogprobs, k: int) -> Tokens:
    """The prompt's tokens as the head of a choice's `logprobs` (k alternatives each)."""
    tops: list[TopLogprobs | None] = [None]
    if k and scored.top is not None:
        tops += [TopLogprobs(token_ids=t.token_ids[:k], logprobs=t.logprobs[:k], texts=t.texts[:k])
                 for t in scored.top[1:]]
    else:
        tops += [None] * (len(scored.token_ids) - 1)
    return Tokens(texts=list(scored.texts), logprobs=list(scored.logprobs), tops=tops, ids=list(scored.token_ids))


def joined(head: Tokens, tail: Tokens | None) -> Tokens:
    """The echoed prompt's tokens, then the completion's."""
    if tail is None:
        return head
    return Tokens(texts=head.texts + tail.texts, logprobs=head.logprobs + tail.logprobs, tops=head.tops + tail.tops,
                  ids=head.ids + tail.ids)


def first_top_null(logprobs: dict[str, object] | None) -> dict[str, object] | None:
    """OpenAI's echo shape: the first prompt token has no alternatives (null), as its logprob."""
    if logprobs is not None and logprobs.get("top_logprobs"):
        logprobs["top_logprobs"][0] = None  # type: ignore[index]
    return logprobs


def vllm_prompt_logprobs(scored: PromptLogprobs, k: int) -> list[dict[str, dict[str, object]] | None]:
    """vLLM's `prompt_logprobs`: null for the first token, then per token a map from token id
    (a string, as JSON keys are) to logprob, rank and decoded_token: the prompt token's and its
    k most likely alternatives'."""
    out: list[dict[str, dict[str, object]] | None] = [None]
    for i in range(1, len(scored.token_ids)):
        entry: dict[str, dict[str, object]] = {str(scored.token_ids[i]): {
            "logprob": scored.logprobs[i], "rank": scored.ranks[i], "decoded_token": scored.texts[i]}}
        top = scored.top[i] if scored.top is not None else None
        if top is not None:
            for rank, (token, lp, text) in enumerate(zip(top.token_ids[:k], top.logprobs[:k], top.texts[:k]), 1):
                entry.setdefault(str(token), {"logprob": lp, "rank": rank, "decoded_token": text})
        out.append(entry)
    return out
