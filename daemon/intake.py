"""Prompts on their way in: bounded before any work, tokenized off the event loop.

Owns the checks a prompt passes before it reaches a scheduler (context length, vocabulary,
`max_tokens` against what the context leaves), the cheap size bound that refuses a text
prompt too long for the context before it is tokenized, the tokenizer's worker threads
(server.tokenizer_threads), and each client's budget of prompt bytes waiting for them
(server.max_queued_prompt_bytes_per_client). Never tokenizes on the event loop: one
client's huge or numerous prompts must not delay another client's tokens.
"""
from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from loraplex.daemon.serving_adapters import Rejected
from loraplex.ipc.errors import ErrorCode

log = logging.getLogger("loraplex.daemon")

# Normalizers (NFC and the like) may shrink text before it is split: composing three code points
# into one is the most Unicode normalization does, so a factor of 4 keeps the bound conservative.
NORMALIZER_SLACK = 4


def longest_token_chars(tokenizer: Any) -> int:
    """An upper bound on the prompt characters one token can cover: the longest vocabulary entry
    in UTF-8 bytes (byte-level and SentencePiece entries spell each byte with one or more bytes)."""
    return max((len(token.encode("utf-8")) for token in tokenizer.get_vocab(with_added_tokens=True)), default=1)


def _encode(tokenizer: Any, text: str) -> list[int]:
    # encode_batch releases the GIL while it works; encode was measured holding it for up to two
    # seconds of a 3 MB prompt, which would stall the event loop even from a worker thread.
    return tokenizer.encode_batch([text])[0].ids


class PromptIntake:
    """The model's limits and tokenizer (None: only token-id prompts are accepted)."""

    def __init__(self, tokenizer: Any, max_model_len: int, vocab_size: int, *, threads: int,
                 max_queued_bytes_per_client: int) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.max_queued_bytes = max_queued_bytes_per_client
        self.token_chars = longest_token_chars(tokenizer) if tokenizer is not None else 0
        # More characters than this cannot fit in the context whatever the text is.
        self.max_prompt_chars = max_model_len * self.token_chars * NORMALIZER_SLACK
        self._executor = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="tokenizer") \
            if tokenizer is not None else None
        self._queued: dict[bytes, int] = {}  # client identity -> prompt bytes handed to the threads

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)

    def queued_bytes(self, identity: bytes) -> int:
        return self._queued.get(identity, 0)

    def check_text(self, text: str) -> None:
        """Refuse, before any work, a text prompt that cannot be tokenized here or cannot fit."""
        if self.tokenizer is None:
            raise Rejected(ErrorCode.INVALID_FIELD, "this model has no tokenizer.json; send prompt_token_ids")
        if len(text) > self.max_prompt_chars:
            raise Rejected(ErrorCode.PROMPT_TOO_LONG,
                           f"the prompt has {len(text)} characters: more than the context of {self.max_model_len} "
                           f"tokens can hold (no token of this model covers more than {self.token_chars} "
                           "characters); refused before tokenizing")

    async def encode(self, identity: bytes, text: str) -> list[int]:
        """The prompt's token ids, computed in a tokenizer thread. A client whose earlier prompts
        are still waiting for the threads gets `overloaded` past its byte budget (one prompt
        alone always goes). Its bytes count until the thread is done with them, even when the
        awaiting request was cancelled meanwhile."""
        size = len(text.encode("utf-8", "surrogatepass"))
        queued = self._queued.get(identity, 0)
        if queued and queued + size > self.max_queued_bytes:
            raise Rejected(ErrorCode.OVERLOADED,
                           f"this client already has {queued} bytes of prompts waiting to be tokenized "
                           f"(server.max_queued_prompt_bytes_per_client = {self.max_queued_bytes}); try again later")
        self._queued[identity] = queued + size
        loop = asyncio.get_running_loop()
        work = self._executor.submit(_encode, self.tokenizer, text)
        work.add_done_callback(lambda _: _call_soon(loop, self._release, identity, size))
        ids = await asyncio.wrap_future(work)
        if not ids:
            raise Rejected(ErrorCode.INVALID_FIELD, "the prompt encodes to no tokens")
        return ids

    def _release(self, identity: bytes, size: int) -> None:
        left = self._queued.get(identity, 0) - size
        if left > 0:
            self._queued[identity] = left
        else:
            self._queued.pop(identity, None)

    def check_ids(self, ids: list[int], max_tokens: int | None) -> int:
        """Check a prompt's ids against the model; return how many tokens it may generate:
        `max_tokens`, or all the context leaves when None (vLLM's default). Refused when the
        prompt plus `max_tokens` exceed the context, as vLLM does, rather than silently cut."""
        limit = self.max_model_len
        if len(ids) >= limit:  # before the scan below: O(1) first
            raise Rejected(ErrorCode.PROMPT_TOO_LONG,
                           f"prompt has {len(ids)} tokens; the context holds {limit} (prompt + at least 1 new token)")
        if ids and not (0 <= min(ids) and max(ids) < self.vocab_size):
            bad = next(t for t in ids if not 0 <= t < self.vocab_size)
            raise Rejected(ErrorCode.INVALID_TOKEN,
                           f"token id {bad} is outside the vocabulary (size {self.vocab_size})")
        room = limit - len(ids)
        if max_tokens is None:
            return room
        if max_tokens > room:
            raise Rejected(ErrorCode.CONTEXT_LENGTH_EXCEEDED,
                           f"max_tokens is {max_tokens} but the prompt has {len(ids)} tokens and the context holds "
                           f"{limit}: at most {room} new tokens fit; lower max_tokens or leave it unset")
        return max_tokens


def _call_soon(loop: asyncio.AbstractEventLoop, fn: Any, *args: Any) -> None:
    """From a tokenizer thread; a loop already closed (the daemon stopping) has nothing left to count."""
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:
        pass
