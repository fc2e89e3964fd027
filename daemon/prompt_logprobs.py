"""One request's prompt logprobs as the engine's step results bring them (chunked prefill: one
chunk of prompt tokens per step), and the `PromptLogprobs` its `done` reply carries.

A prompt computed again (preemption, an engine restart) is scored again: the values already
kept stand and the repeats are dropped, so the reply holds each prompt token once. Torch-free.
"""
from __future__ import annotations

from typing import Any

from loraplex.daemon.detokenizer import IncrementalDetokenizer
from loraplex.daemon.rejected import Rejected
from loraplex.ipc.engine_plan import MAX_PROMPT_LOGPROB_ENTRIES, PromptLogprobChunk
from loraplex.ipc.errors import ErrorCode
from loraplex.ipc.protocol import MAX_TOKEN_TEXT_LEN, GenerateRequest, PromptLogprobs, TopLogprobs


def check_prompt_logprobs(msg: GenerateRequest, prompt_len: int) -> None:
    """Rejected (too_large) when the request asks for more prompt logprob entries (prompt tokens x
    (1 + alternatives)) than a reply carries."""
    k = msg.prompt_logprobs
    if k is None:
        return
    if prompt_len * (k + 1) > MAX_PROMPT_LOGPROB_ENTRIES:
        raise Rejected(ErrorCode.TOO_LARGE, f"prompt_logprobs: {prompt_len} prompt tokens x {k + 1} entries each "
                                            f"exceed {MAX_PROMPT_LOGPROB_ENTRIES}; ask for fewer alternatives "
                                            "or send a shorter prompt")


class PromptLogprobBook:
    """Prompt tokens 1.. scored so far, in order (token 0 has no prefix, hence no logprob)."""

    def __init__(self, k: int) -> None:
        self.k = k
        self.logprobs: list[float] = []
        self.ranks: list[int] = []
        self.top_ids: list[list[int]] = []
        self.top_logprobs: list[list[float]] = []

    def add(self, chunk: PromptLogprobChunk) -> None:
        """Keep the chunk's tokens not kept yet; a chunk past a gap is dropped (the reply then says
        nothing rather than something misplaced)."""
        skip = 1 + len(self.logprobs) - chunk.first
        if skip < 0 or skip >= len(chunk.logprobs):
            return
        self.logprobs += chunk.logprobs[skip:]
        self.ranks += chunk.ranks[skip:]
        if self.k:
            self.top_ids += [ids[:self.k] for ids in chunk.top_ids[skip:]]
            self.top_logprobs += [lps[:self.k] for lps in chunk.top_logprobs[skip:]]

    def reply(self, prompt_ids: list[int], tokenizer: Any) -> PromptLogprobs | None:
        """The reply's PromptLogprobs; None until every prompt token is scored. A prompt token's
        text is what it adds to the text before it (incremental detokenization: the pieces join
        into the prompt's text); an alternative's is the token decoded alone (as vLLM spells
        them), once per distinct id."""
        n = len(prompt_ids)
        if n == 0 or 1 + len(self.logprobs) < n:
            return None
        texts: dict[int, str] = {}

        def text(token: int) -> str:
            if token not in texts:
                texts[token] = tokenizer.decode([token], skip_special_tokens=False)[:MAX_TOKEN_TEXT_LEN] \
                    if tokenizer is not None else ""
            return texts[token]

        m = n - 1
        top = None
        if self.k:
            top = [TopLogprobs(token_ids=[], logprobs=[], texts=[])] + [
                TopLogprobs(token_ids=list(ids), logprobs=list(lps), texts=[text(t) for t in ids])
                for ids, lps in zip(self.top_ids[:m], self.top_logprobs[:m])]
        return PromptLogprobs(token_ids=list(prompt_ids), texts=_pieces(prompt_ids, tokenizer),
                              logprobs=[None] + self.logprobs[:m], ranks=[None] + self.ranks[:m], top=top)


def _pieces(ids: list[int], tokenizer: Any) -> list[str]:
    """The text each token adds after those before it (a tail held back for an incomplete
    character goes to the last token); each cut to MAX_TOKEN_TEXT_LEN."""
    if tokenizer is None:
        return [""] * len(ids)
    detok = IncrementalDetokenizer(tokenizer)
    pieces = [detok.push([token]) for token in ids]
    pieces[-1] += detok.flush()
    return [piece[:MAX_TOKEN_TEXT_LEN] for piece in pieces]
